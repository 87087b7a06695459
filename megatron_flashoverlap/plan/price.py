"""What a walk is priced with: the environment (GPU, GEMM model, network) and one `Side` per slice tag.

    Env(cluster, dtype)   gemm: GemmModel (or a measured table), net: Net (or plan/proxy.py's measured one),
                          bytes: the activation dtype's size (what reduce-scatters, all-reduces and the
                          elementwise work move), gather_bytes: what an all-gather of a GEMM operand carries,
                          slowdown. dtype "fp8": the TP GEMMs run FP8 (Transformer Engine's recipes and ours:
                          activations bf16, each GEMM operand cast to FP8 once per call, the all-gathers carry
                          FP8 bytes, the reduce-scatter partials bf16); cast(elements) prices those casts
    Side                  one tag of a step list: compute(slice) seconds, nbytes(slice) of its point-to-point
                          transfers, collective(slice) seconds where its transfers are stock collectives (tags >=
                          steps.COLL) and collective_fixed(slice) the host part of those (Net.collective_fixed),
                          arrival seconds of handling one arrived transfer (e.g. the add of a partial)
    collective_side(env, group, kind, nbytes)   -> the Side of units that are each one stock call: its price and
                          its host part from the net together; collectives_side(env, group, calls): block j's
                          unit the call calls[j] = (kind, nbytes)
    prices(env, group, sides, pairwise)   -> walk.Prices for a ring (pairwise: all-to-all / doubling) on `group`;
                          where the thread that posts is the one that computes (Net.host_is_compute), a stock
                          collective's host part runs on the backend's worker beside the compute (walk.py)
    walk_clock(env, step_lists, prices)   -> the clock after walks run one after another
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..schedules import Slice, Step
from .gemm import GemmModel
from .hardware import DTYPE_BYTES, Cluster
from .links import Group, Net
from .walk import Clock, Prices, run

ACC_BYTES = 4  # partial sums and weight gradients accumulate in fp32 (runtime/numerics.py)


class Env:
    """The priced machine: cluster, dtype, GEMM model (a measured table may replace it), network."""

    def __init__(self, cluster: Cluster, dtype: str = "bf16", gemm: GemmModel | None = None, net: Net | None = None):
        self.cluster, self.dtype = cluster, dtype
        self.gemm = gemm if gemm is not None else GemmModel(cluster.gpu, dtype)
        self.net = net if net is not None else Net(cluster)
        self.act_dtype = "bf16" if dtype == "fp8" else dtype  # activations, attention, what the rest moves
        self.bytes = DTYPE_BYTES[self.act_dtype]
        self.gather_bytes = DTYPE_BYTES[dtype]
        self.slowdown = cluster.slowdown

    def cast(self, elements: float) -> float:
        """Seconds of FP8 casts of `elements` (an amax pass reading bf16, then the cast: read bf16, write FP8);
        0 without FP8."""
        return self.gemm.elementwise(elements * (2 + 2 + 1), 1.0) if self.dtype == "fp8" else 0.0

    def mm(self, m: float, k: float, n: float) -> float:
        """Seconds of one GEMM y[m, n] = x[m, k] w[k, n] (fractional sizes rounded, at least 1 row)."""
        return self.gemm.time(max(1, round(m)), max(1, round(k)), max(1, round(n)))

    def add(self, elements: float, nbytes: int = ACC_BYTES) -> float:
        """One elementwise add of `elements` (an arrived partial into its sum)."""
        return self.gemm.elementwise(elements * nbytes)


def _zero(_: Slice) -> float:
    return 0.0


@dataclass(frozen=True)
class Side:
    compute: Callable[[Slice], float] = _zero
    nbytes: Callable[[Slice], float] = _zero
    collective: Callable[[Slice], float] | None = None
    collective_fixed: Callable[[Slice], float] = _zero
    arrival: float = 0.0
    name: str = ""


def collective_side(env: Env, group: Group, kind: str, nbytes: float) -> Side:
    """Units that are each one stock `kind` call over `nbytes` (module docstring)."""
    seconds, fixed = env.net.collective(kind, nbytes, group), env.net.collective_fixed(kind, group)
    return Side(collective=lambda x: seconds, collective_fixed=lambda x: fixed)


def collectives_side(env: Env, group: Group, calls: Sequence[tuple[str, float]]) -> Side:
    """Block j's unit is the stock call calls[j] = (kind, nbytes) (module docstring)."""
    seconds = [env.net.collective(kind, n, group) for kind, n in calls]
    fixed = [env.net.collective_fixed(kind, group) for kind, _ in calls]
    return Side(collective=lambda x: seconds[x.block], collective_fixed=lambda x: fixed[x.block])


def prices(env: Env, group: Group, sides: Mapping[int, Side], pairwise: bool = False) -> Prices:
    """Prices of one walk over `group` (module docstring)."""
    inter = group.spans
    senders = env.net.pair_senders(group) if pairwise else env.net.ring_senders(group)

    def collectives(sends) -> list | None:
        """The stock collectives of a unit's sends, None where the unit is point-to-point hops."""
        colls = [sides[t.slice.tag].collective for t in sends]
        return colls if colls and colls[0] is not None else None

    def transfer(sends, recvs) -> float:
        colls = collectives(sends)
        if colls is not None:
            return sum(c(t.slice) for c, t in zip(colls, sends))
        sent = sum(sides[t.slice.tag].nbytes(t.slice) for t in sends)
        got = sum(sides[t.slice.tag].nbytes(t.slice) for t in recvs)
        return env.net.hop(sent, got, inter, senders)

    def label(x: Slice) -> str:
        name = sides[x.tag].name
        return f"{name} {x.block}.{x.part}" if name else x.label()

    def fixed(sends, recvs) -> float:
        if collectives(sends) is not None:
            return sum(sides[t.slice.tag].collective_fixed(t.slice) for t in sends)
        return env.net.hop_fixed(inter)

    def worker(sends, recvs) -> bool:
        return env.net.host_is_compute and collectives(sends) is not None

    return Prices(compute=lambda x: sides[x.tag].compute(x), transfer=transfer,
                  arrived=lambda t: sides[t.slice.tag].arrival, label=label, fixed=fixed,
                  post_blocks=env.net.host_is_compute, worker=worker)


def walk_clock(env: Env, step_lists: Sequence[Sequence[Step]], walk_prices: Prices, lane: str = "") -> Clock:
    """The clock after walking each step list in turn (each a separate executor walk)."""
    clock = Clock()
    for steps in step_lists:
        run(steps, walk_prices, env.slowdown, clock, lane)
    return clock
