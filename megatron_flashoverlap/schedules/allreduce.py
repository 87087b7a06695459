"""All-reduce schedules ("exchange"): ring (RS + AG), flat recursive doubling, hierarchical, pipelined hierarchical.

P = world_size ranks, G = local_world_size ranks per node, N = P / G nodes, node-contiguous ranks:
rank = node * G + local. The message is cut in G blocks; `Slice(b)` is block b (the whole message when
G = 1). Every rank starts holding its own contribution to every block (`local`) and must end holding
every rank's contribution to every block exactly once (`final`). A receive adds what arrives, except
`Transfer(op="copy")`, which replaces what is held (the all-gather and fold-back halves).

hierarchical (G per node, N nodes):
    1. ring reduce-scatter inside the node      G-1 steps   block l ends summed over the node on local rank l
    2. recursive doubling across nodes           log2(N') steps among ranks of the same local rank,
       on block l only                           partner = node XOR 2^k (in the folded numbering)
    3. ring all-gather inside the node           G-1 steps   copies
ring = hierarchical with G = P (one node); recursive_doubling = hierarchical with G = 1 (one block).
Latency terms: 2(G-1) intra + log2(N') inter (+2 for a fold), against 2(P-1) for the ring.

hierarchical_pipelined (K = PIECES): the message is cut in K pieces of G blocks (piece k holds blocks
k*G .. k*G+G-1); each piece runs the hierarchical steps above, piece k starting at step k, so while piece k
crosses the inter-node link, piece k+1 is reduce-scattered and piece k-1 all-gathered inside the node:

    step       0      1      2      3      4      5          (2x2: 1 RS + 1 inter + 1 AG step per piece)
    piece 0    RS     inter  AG
    piece 1           RS     inter  AG
    piece 2                  RS     inter  AG
    piece 3                         RS     inter  AG
The inter-node link is busy from step 1 to step K while the single hierarchical keeps it idle during its
intra-node phases; it costs K-1 more latency terms, so it is for the larger messages (the calibration decides).

hierarchical_hd (halving-doubling across nodes): the message in G super-blocks of M = N' blocks each; the
intra-node ring moves whole super-blocks; across nodes, on super-block l: recursive halving (step k: send half
of what is held to the partner at distance M/2^(k+1), add the other half from it; ends holding one block) then
recursive doubling back (copies). Inter-node bytes per rank 2(M-1)/M n/G instead of log2(M) n/G: for more than
two nodes (at two it equals recursive doubling with one more step). 2(G-1) + 2 log2(N') steps (+2 fold).

Non-power-of-two counts (N' = largest power of two <= N, rem = N - N'): among the first 2*rem members,
each even member sends its value to the odd one above it (pre-reduce) and sits out; the odd one takes
part under index i // 2, the others under i - rem; after the doubling the odd member copies the result
back down (Rabenseifner/Thakur). Two extra latency terms, any count works.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .ring import _check
from .step import Schedule, Slice, Step, Transfer


def _ring_reduce_scatter(members: list[int], i: int, tag: int, base: int = 0) -> list[Step]:
    """Block base+b ends summed on member b: step s sends block (i-s-1) on, adds block (i-s-2) from prev."""
    g = len(members)
    nxt, prv = members[(i + 1) % g], members[(i - 1) % g]
    return [Step(sends=(Transfer(nxt, Slice(base + (i - s - 1) % g, 0, tag)),),
                 recvs=(Transfer(prv, Slice(base + (i - s - 2) % g, 0, tag)),)) for s in range(g - 1)]


def _ring_all_gather(members: list[int], i: int, tag: int, base: int = 0) -> list[Step]:
    """Member b holds the finished block base+b: step s forwards block (i-s), copies block (i-s-1) from prev."""
    g = len(members)
    nxt, prv = members[(i + 1) % g], members[(i - 1) % g]
    return [Step(sends=(Transfer(nxt, Slice(base + (i - s) % g, 0, tag)),),
                 recvs=(Transfer(prv, Slice(base + (i - s - 1) % g, 0, tag), op="copy"),)) for s in range(g - 1)]


def _folded(m: int, i: int) -> tuple[int, int, int | None]:
    """(power-of-two size m', rem, index among the m' doubling members or None if member i sits out)."""
    p2 = 1 << (m.bit_length() - 1)
    rem = m - p2
    if i < 2 * rem:
        return p2, rem, (i // 2 if i % 2 else None)
    return p2, rem, i - rem


def _recursive_doubling(members: list[int], i: int, x: Slice) -> list[Step]:
    """All-reduce of slice x among `members` (any count): fold, log2(m') whole-slice exchanges, unfold."""
    m = len(members)
    p2, rem, new = _folded(m, i)
    if new is None:  # even member of the folded prefix: hand the value up, idle while it doubles, get the sum
        up = members[i + 1]  # (the idle steps keep every member's steps aligned: pieces stagger by whole steps)
        idle = [Step()] * (p2.bit_length() - 1)
        return [Step(sends=(Transfer(up, x),)), *idle, Step(recvs=(Transfer(up, x, op="copy"),))]
    folded = i < 2 * rem
    steps = [Step(recvs=(Transfer(members[i - 1], x),))] if folded else []
    for k in range(p2.bit_length() - 1):
        pn = new ^ (1 << k)
        peer = members[2 * pn + 1 if pn < rem else pn + rem]
        steps.append(Step(sends=(Transfer(peer, x),), recvs=(Transfer(peer, x),)))
    if folded:
        steps.append(Step(sends=(Transfer(members[i - 1], x),)))
    return steps


def _layout(world_size: int, local_world_size: int) -> int:
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"local_world_size {local_world_size} does not divide the group size {world_size}; "
                         f"pass the number of group ranks per node (every node must hold as many)")
    return world_size // local_world_size


def _piece(rank: int, g: int, nodes: int, tag: int, base: int) -> list[Step]:
    """One piece's steps (blocks base .. base+G-1): intra RS, inter recursive doubling, intra AG."""
    node, local = divmod(rank, g)
    intra = [node * g + j for j in range(g)]
    inter = [n * g + local for n in range(nodes)]
    return (_ring_reduce_scatter(intra, local, tag, base)
            + _recursive_doubling(inter, node, Slice(base + local, 0, tag)) + _ring_all_gather(intra, local, tag, base))


def _staggered(pieces: list[list[Step]]) -> tuple[Step, ...]:
    """Piece k's steps start at step k; the pieces in flight at a step post together (one Step)."""
    n = max(k + len(p) for k, p in enumerate(pieces))
    out = []
    for i in range(n):
        parts = [p[i - k] for k, p in enumerate(pieces) if 0 <= i - k < len(p)]
        out.append(Step(sends=tuple(t for s in parts for t in s.sends),
                        recvs=tuple(t for s in parts for t in s.recvs)))
    return tuple(out)


def all_reduce_hierarchical(rank: int, world_size: int, local_world_size: int, *, tag: int = 0, pieces: int = 1,
                            name: str = "all_reduce_hierarchical") -> Schedule:
    """Intra-node ring RS, inter-node recursive doubling among same-local-rank ranks, intra-node ring AG;
    `pieces` K > 1: the message in K pieces of G blocks, piece k staggered by k steps (module docstring)."""
    _check(rank, world_size)
    g = local_world_size
    nodes = _layout(world_size, g)
    if pieces < 1:
        raise ValueError(f"all_reduce_hierarchical: pieces={pieces}; ask for 1 or more")
    steps = _staggered([_piece(rank, g, nodes, tag, k * g) for k in range(pieces)])
    blocks = tuple(Slice(b, 0, tag) for b in range(g * pieces))
    return Schedule("exchange", rank, world_size, steps, name=name, local=blocks, final=blocks)


def _wide(steps: list[Step], width: int) -> list[Step]:
    """Each transfer of block b becomes `width` transfers of blocks b*width .. b*width+width-1 (a super-block)."""
    def w(ts):
        return tuple(Transfer(t.peer, Slice(t.slice.block * width + j, 0, t.slice.tag), t.op) for t in ts
                     for j in range(width))
    return [Step(sends=w(st.sends), recvs=w(st.recvs)) for st in steps]


def _halving_doubling(members: list[int], i: int, base: int, m: int, tag: int) -> list[Step]:
    """All-reduce of blocks base .. base+m-1 (m = the power-of-two part of len(members)) among `members`:
    fold, recursive halving reduce-scatter (log2 m steps), recursive doubling all-gather (copies), unfold."""
    blocks = [Slice(base + j, 0, tag) for j in range(m)]
    p2, rem, new = _folded(len(members), i)
    levels = p2.bit_length() - 1
    if new is None:  # even member of the folded prefix: hand the blocks up, idle, get the sums back
        up = members[i + 1]
        return [Step(sends=tuple(Transfer(up, x) for x in blocks)), *[Step()] * (2 * levels),
                Step(recvs=tuple(Transfer(up, x, op="copy") for x in blocks))]
    folded = i < 2 * rem

    def peer(v):
        return members[2 * v + 1 if v < rem else v + rem]
    steps = [Step(recvs=tuple(Transfer(members[i - 1], x) for x in blocks))] if folded else []
    lo, held = 0, []
    for k in range(levels):  # halving: keep the half named by bit (levels-1-k) of the new index
        d = m >> (k + 1)
        keep = (lo, lo + d) if not new & d else (lo + d, lo + 2 * d)
        give = (lo + d, lo + 2 * d) if not new & d else (lo, lo + d)
        steps.append(Step(sends=tuple(Transfer(peer(new ^ d), blocks[j]) for j in range(*give)),
                          recvs=tuple(Transfer(peer(new ^ d), blocks[j]) for j in range(*keep))))
        held.append((d, keep, give))
        lo = keep[0]
    for d, keep, give in reversed(held):  # doubling: send what is held, copy the partner's half
        steps.append(Step(sends=tuple(Transfer(peer(new ^ d), blocks[j]) for j in range(*keep)),
                          recvs=tuple(Transfer(peer(new ^ d), blocks[j], op="copy") for j in range(*give))))
    if folded:
        steps.append(Step(sends=tuple(Transfer(members[i - 1], x) for x in blocks)))
    return steps


def all_reduce_hierarchical_hd(rank: int, world_size: int, local_world_size: int, *, tag: int = 0) -> Schedule:
    """Intra-node ring RS of super-blocks, inter-node halving-doubling on super-block `local`, intra-node ring AG."""
    _check(rank, world_size)
    g = local_world_size
    nodes = _layout(world_size, g)
    m = 1 << (nodes.bit_length() - 1)
    node, local = divmod(rank, g)
    intra = [node * g + j for j in range(g)]
    inter = [n * g + local for n in range(nodes)]
    steps = (_wide(_ring_reduce_scatter(intra, local, tag), m) + _halving_doubling(inter, node, local * m, m, tag)
             + _wide(_ring_all_gather(intra, local, tag), m))
    blocks = tuple(Slice(b, 0, tag) for b in range(g * m))
    return Schedule("exchange", rank, world_size, tuple(steps), name="all_reduce_hierarchical_hd", local=blocks,
                    final=blocks)


PIECES = 4  # K of hierarchical_pipelined: the link idles at most 1/K of the inter phase while the ends fill


def all_reduce_hierarchical_pipelined(rank: int, world_size: int, local_world_size: int, *, tag: int = 0,
                                      pieces: int = PIECES) -> Schedule:
    """hierarchical in K pieces, staggered by one step each (module docstring): 2(G-1) + log2(N') + K-1 steps."""
    return all_reduce_hierarchical(rank, world_size, local_world_size, tag=tag, pieces=pieces,
                                   name="all_reduce_hierarchical_pipelined")


def all_reduce_ring(rank: int, world_size: int, *, tag: int = 0) -> Schedule:
    """Flat ring all-reduce = reduce-scatter + all-gather over P blocks: 2(P-1) steps."""
    return all_reduce_hierarchical(rank, world_size, world_size, tag=tag, name="all_reduce_ring")


def all_reduce_recursive_doubling(rank: int, world_size: int, *, tag: int = 0) -> Schedule:
    """Flat recursive doubling on the whole message: log2(P') steps (+2 to fold a non-power-of-two P)."""
    return all_reduce_hierarchical(rank, world_size, 1, tag=tag, name="all_reduce_recursive_doubling")


@dataclass(frozen=True)
class AllReduceWord:
    """One all-reduce algorithm word: its builder and what the rest of the package needs to know of it.

    build(rank, world_size, local_world_size, *, tag) -> Schedule   (local_world_size: G, the ranks per node)
    two_level   it reads the node layout (G), so a caller must know it; the flat words ignore G
    distinct(P, G) -> bool   the layouts where it differs from every other word, so `auto` measures it there
    summary     one line: what it sends, for the operator's docstring and the docs"""

    build: Callable[..., Schedule]
    two_level: bool
    distinct: Callable[[int, int], bool]
    summary: str


def _flat(build):
    return lambda rank, world_size, local_world_size, *, tag=0: build(rank, world_size, tag=tag)


def _two_level(world: int, local: int) -> bool:
    return 1 < local < world


# The one table of all-reduce words: a new schedule is a builder above and a row here (docs/design.md).
ALL_REDUCE = {
    "ring": AllReduceWord(_flat(all_reduce_ring), False, lambda p, g: True,
                          "RS + AG over P blocks: 2(P-1) steps of n/P"),
    "recursive_doubling": AllReduceWord(_flat(all_reduce_recursive_doubling), False, lambda p, g: True,
                                        "log2(P') whole-message exchanges (+2 to fold a non-power-of-two P)"),
    "hierarchical": AllReduceWord(all_reduce_hierarchical, True, _two_level,
                                  "intra-node RS, inter-node recursive doubling on n/G, intra-node AG"),
    "hierarchical_pipelined": AllReduceWord(all_reduce_hierarchical_pipelined, True, _two_level,
                                            "hierarchical on K pieces of n/K, staggered by a step: piece k "
                                            "crosses nodes while k+1 is reduce-scattered"),
    "hierarchical_hd": AllReduceWord(all_reduce_hierarchical_hd, True, lambda p, g: _two_level(p, g) and p // g > 2,
                                     "intra-node RS, inter-node halving-doubling on n/G (2(N'-1)/N' n/G "
                                     "bytes), intra-node AG"),
}
ALL_REDUCE_SCHEDULES = tuple(ALL_REDUCE)


def all_reduce_schedule(algo: str, rank: int, world_size: int, local_world_size: int | None = None,
                        *, tag: int = 0) -> Schedule:
    """The schedule of `algo` (a key of ALL_REDUCE); `local_world_size` (default: one node) only matters to the
    two-level words."""
    if algo not in ALL_REDUCE:
        raise ValueError(f"unknown all-reduce schedule {algo!r}; choose one of {ALL_REDUCE_SCHEDULES}")
    return ALL_REDUCE[algo].build(rank, world_size, local_world_size or world_size, tag=tag)
