"""Transfers priced per link level: our executor's point-to-point hops, and stock's NCCL collectives.

Group placement (Megatron's rank order tp-cp-ep-dp-pp: a group's consecutive members are `stride` global ranks
apart, node-contiguous ranks, G GPUs per node):

    per_node   group members on one node: the whole group if size * stride <= G, else G // stride (>= 1)
    colocated  groups of this kind with members on each node (G // per_node): their inter-node flows share the
               node's NICs, nics_per_node of them

A hop of a ring over a group that spans nodes is priced on the inter-node link: a ring waits for its slowest edge.

One hop (a post of sends/receives; the executor waits on all of them together):
    time = p2p_us + max(bytes sent, bytes received) / rate
    rate = link GB/s * p2p_efficiency                          inside a node (every flow of the GPU shares its
                                                              NVLink egress: a bidirectional ring gains no bytes/s)
         = NIC GB/s * p2p_efficiency * min(1, NICs / senders)  across nodes (senders: flows leaving the node at once)

A stock collective, as one torch.distributed call: call_us + NCCL's kernel (`kernel`: NCCL's own model, catalog
[nccl], as of NCCL 2.27). For each protocol (LL, LL128, Simple)
    time = base + intra_steps * hop_intra + inter_steps * hop_inter + bus_bytes / (busbw * protocol factor)
with ring bus bytes (P-1)/P * total (all-gather, reduce-scatter) or 2(P-1)/P * total (all-reduce), busbw =
link GB/s * coll_efficiency (across nodes the lower of that and the NICs' share); LL moves at half of it,
capped at NCCL's llMaxBw, LL128 at 0.92 of it; across nodes a step inside a node costs at least NCCL's network
overhead and the all-reduce's Simple ring its plateau (x1.4); NCCL takes the fastest. All-reduce also has a tree (across
nodes: 2 log2(N) inter steps, NCCL's per-size correction of the tree's bandwidth) and, inside one node where
the link has it, NVLink SHARP (NVLS): NCCL's 25 us, then the message's first NVLS_RAMP_BYTES at the measured
mid-size rate and the rest at the large-message rate (catalog [azure-nccl]). All-to-all: every peer at once,
(P-1)/P of the buffer out of each GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Cluster, Link

LL, LL128, SIMPLE = range(3)
_RING_FACTOR = {LL: 0.5, LL128: 0.92, SIMPLE: 1.0}  # [nccl] busbw factor per protocol
_NET_OVERHEAD = (1.0, 1.0, 3.0)  # [nccl] a ring step's floor across nodes (Intel hosts), LL, LL128, Simple, us
_LL_MAX_NET = {2: 39.0, 4: 20.4}  # [nccl] llMaxBws across nodes (Intel hosts), GB/s: 2 nodes, more
_TREE_BASE = (6.8, 14.0)  # [nccl] tree base latency (LL, LL128), us
_TREE_HOP = {False: (0.6, 1.25), True: (5.0, 8.5)}  # [nccl] tree hwLat (LL, LL128): NVLink, NET
# [nccl] treeCorrectionFactor (LL, LL128): the tree's bandwidth by log2(bytes / 64), powers of two up to 256 MiB
_TREE_CORRECTION = ((1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0,
                     1.0, 1.0),
                    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0,
                     1.0, 1.0))
NVLS_US = 25.0  # [nccl] NVLS hwLat on NVLink (its base latency is 0), us
NVLS_RAMP_BYTES = 16 * 2 ** 20  # [azure-nccl] the part of a message NVLS moves at its mid-size rate


@dataclass(frozen=True)
class Group:
    """A process group as priced: `size` ranks, `per_node` of them on each node, `colocated` such groups per node."""

    size: int
    per_node: int
    colocated: int = 1

    def __post_init__(self):
        if self.size < 1 or self.per_node < 1 or self.size % self.per_node:
            raise ValueError(f"group of {self.size} ranks with {self.per_node} per node: the per-node count must "
                             f"divide the size")

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @property
    def spans(self) -> bool:
        return self.nodes > 1

    def node_of(self, rank: int) -> int:
        return rank // self.per_node


def place(size: int, stride: int, cluster: Cluster) -> Group:
    """The group of `size` members `stride` global ranks apart (module docstring)."""
    g = cluster.gpus_per_node
    if size * stride <= g:
        per_node = size
    elif stride >= g:
        per_node = 1
    else:
        per_node = max(1, g // stride)
    if size % per_node:
        raise ValueError(f"a group of {size} ranks, {stride} apart, does not tile nodes of {g} GPUs; choose sizes "
                         f"whose product with the lower dimensions divides or is a multiple of --gpus-per-node")
    return Group(size, per_node, max(1, g // per_node))


class Net:
    """Prices hops and collectives on `cluster`. host_is_compute: False on GPUs (the host posts ahead of the
    compute stream); True on the CPU proxy (proxy.ProxyNet), where the thread that posts is the one that computes."""

    host_is_compute = False

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def _nic_share(self, senders: int) -> float:
        return min(1.0, self.cluster.nics_per_node / max(1, senders))

    def hop(self, sent: float, received: float, inter: bool, senders: int = 1) -> float:
        """Seconds of one post of our executor moving `sent` / `received` bytes (module docstring)."""
        link = self.cluster.link(inter)
        rate = link.gbps * 1e9 * link.p2p_efficiency * (self._nic_share(senders) if inter else 1.0)
        return link.p2p_us * 1e-6 + max(sent, received) / rate

    def hop_fixed(self, inter: bool) -> float:
        """Seconds of a hop that are the posting thread's own work (Link.post_us), free to run while the previous
        hop's bytes are in flight (walk.py)."""
        link = self.cluster.link(inter)
        return min(link.p2p_us, link.call_us if link.post_us is None else link.post_us) * 1e-6

    def collective_fixed(self, kind: str, group: Group) -> float:
        """Seconds of one stock collective call that are the posting thread's own work, free to run while the
        previous call's bytes are in flight (walk.py): none on a GPU link (NCCL's call is priced whole, in series;
        splitting it was tried and not kept: benchmarks/planner/RESULTS.md)."""
        return 0.0

    def ring_senders(self, group: Group) -> int:
        """Flows leaving a node at once in a ring step: one per colocated group."""
        return group.colocated

    def pair_senders(self, group: Group) -> int:
        """Flows leaving a node at once in a pairwise step (all-to-all, recursive doubling): every GPU."""
        return self.cluster.gpus_per_node if group.spans else 1

    def _busbw(self, group: Group) -> float:
        c = self.cluster
        intra = c.intra.gbps * c.intra.coll_efficiency * 1e9
        if not group.spans:
            return intra
        inter = c.inter.gbps * c.inter.coll_efficiency * 1e9 * c.nics_per_node / group.colocated
        return min(intra, inter)

    def _ll_cap(self, group: Group) -> float:
        """NCCL's llMaxBw, bytes/s: the GPU generation's inside one node, the host's across nodes."""
        if group.spans:
            return _LL_MAX_NET[2 if group.nodes <= 2 else 4] * 1e9
        return self.cluster.intra.ll_max_gbps * 1e9 or math.inf

    def _ring(self, total: float, group: Group, steps: int, inter_steps: int, all_reduce: bool = False) -> float:
        c = self.cluster
        busbw, best = self._busbw(group), math.inf
        for p in (LL, LL128, SIMPLE):
            hop_intra = max(c.intra.hop_lat_us[p], _NET_OVERHEAD[p]) if group.spans else c.intra.hop_lat_us[p]
            lat = c.intra.base_lat_us[p] + (steps - inter_steps) * hop_intra + inter_steps * c.inter.hop_lat_us[p]
            if all_reduce and group.spans and p == SIMPLE:
                lat *= 1.4  # [nccl] the ring's plateau across nodes (sm80 and later)
            rate = busbw * _RING_FACTOR[p]
            if p == LL:
                rate = min(rate, self._ll_cap(group))
            best = min(best, lat * 1e-6 + steps / group.size * total / rate)
        return best

    def _tree(self, total: float, group: Group) -> float:
        busbw, best = self._busbw(group) * 0.92, math.inf
        size = min(max(0, int(math.log2(max(total, 64) / 64))), len(_TREE_CORRECTION[0]) - 1)
        for p in (LL, LL128):
            rate = min(busbw / 3.8, self._ll_cap(group)) if p == LL else busbw * 120 / 128
            lat = _TREE_BASE[p] + 2 * ((group.per_node - 1) * _TREE_HOP[False][p]
                                       + math.log2(group.nodes) * _TREE_HOP[True][p])
            best = min(best, lat * 1e-6 + 2 * total / (rate * _TREE_CORRECTION[p][size]))
        return best

    def _nvls(self, total: float, group: Group, link: Link) -> float:
        """NCCL's NVLS latency, then the message's first NVLS_RAMP_BYTES at the mid-size rate, the rest at the
        large-message rate (module docstring)."""
        mid = min(total, NVLS_RAMP_BYTES)
        rates = (link.nvls_mid_efficiency or link.nvls_efficiency, link.nvls_efficiency)
        wire = mid / rates[0] + (total - mid) / rates[1]
        return NVLS_US * 1e-6 + 2 * (group.size - 1) / group.size * wire / (link.gbps * 1e9)

    def collective(self, kind: str, total: float, group: Group) -> float:
        """Seconds of one torch.distributed call of stock's NCCL `kind` (all_gather / reduce_scatter: `total` =
        the gathered size; all_reduce: the buffer; all_to_all: each rank's buffer) over `group`: the kernel and
        the call's own cost; 0 for a group of one."""
        if group.size == 1 or total <= 0:
            return 0.0
        return self.kernel(kind, total, group) + self.cluster.link(group.spans).call_us * 1e-6

    def kernel(self, kind: str, total: float, group: Group) -> float:
        """Seconds of NCCL's kernel alone (`collective` without the call's cost), by NCCL's model."""
        p, n = group.size, group.nodes
        if p == 1 or total <= 0:
            return 0.0
        if kind in ("all_gather", "reduce_scatter"):
            return self._ring(total, group, p - 1, n - 1)
        if kind == "all_reduce":
            best = self._ring(total, group, 2 * (p - 1), 2 * (n - 1), all_reduce=True)
            if group.spans:
                best = min(best, self._tree(total, group))
            elif self.cluster.intra.nvls_efficiency > 0:
                best = min(best, self._nvls(total, group, self.cluster.intra))
            return best
        if kind == "all_to_all":
            return self._all_to_all(total, group)
        raise ValueError(f"unknown collective {kind!r}")

    def _all_to_all(self, total: float, group: Group) -> float:
        c = self.cluster
        lat = (c.intra.base_lat_us[SIMPLE] + c.link(group.spans).hop_lat_us[SIMPLE]) * 1e-6
        intra = (group.per_node - 1) / group.size * total / (c.intra.gbps * c.intra.coll_efficiency * 1e9)
        if not group.spans:
            return lat + intra
        share = self._nic_share(c.gpus_per_node)
        inter = (group.size - group.per_node) / group.size * total / (
            c.inter.gbps * c.inter.coll_efficiency * 1e9 * share)
        return lat + max(intra, inter)
