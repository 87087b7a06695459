"""The CPU proxy's priced machine (plan/proxy.py): the fit, the measured net's formulas, the proxy GPU.

Tier: pure (no processes). Expected values are worked out in the comments from the fits the tests give.
"""
import pytest

from megatron_flashoverlap.plan.gemm import TableGemm
from megatron_flashoverlap.plan.hardware import Cluster, Link
from megatron_flashoverlap.plan.links import Group
from megatron_flashoverlap.plan.price import Env
from megatron_flashoverlap.plan.proxy import Fit, ProxyNet, fit, link_fit, probed_env, proxy_gpu

HOP, AG, AR = Fit(1e-3, 1e-8), Fit(2e-3, 2e-8), Fit(3e-3, 3e-8)
FITS = {"hop": HOP, "allgather": AG, "allreduce": AR}


def _net(p=4, shared=True):
    gpu = proxy_gpu(Fit(1e-5, 1e-9))
    link = Link("l", 1.0, 1.0, 1.0, (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), 1.0)
    return ProxyNet(Cluster(gpu, link, link, p, 1, 1, 0.0), FITS, shared)


def test_fit_recovers_a_line_and_clamps():
    f = fit([(0, 1.0), (10, 3.0), (20, 5.0)])  # y = 1 + 0.2 x exactly
    assert f.alpha == pytest.approx(1.0) and f.per_byte == pytest.approx(0.2)
    g = fit([(0, 5.0), (10, 1.0)])  # a falling line: slope clamped at 0
    assert g.per_byte == 0.0 and g.alpha > 0
    with pytest.raises(ValueError, match="two"):
        fit([(1, 1.0)])


def test_shared_net_prices_hops_and_gloo_collectives_from_its_fits():
    net, g = _net(), Group(4, 4)
    assert net.hop(1e6, 2e6, False) == pytest.approx(1e-3 + 2e6 * 1e-8)  # the larger side: 0.021 s
    assert net.collective("all_gather", 4e6, g) == pytest.approx(2e-3 + 1e6 * 2e-8)  # per rank 1e6 bytes
    assert net.collective("all_to_all", 4e6, g) == pytest.approx(2e-3 + 1e6 * 2e-8)
    assert net.collective("reduce_scatter", 4e6, g) == pytest.approx(3 * (1e-3 + 1e6 * 1e-8))  # 3 hops of a chunk
    assert net.collective("all_reduce", 4e6, g) == pytest.approx(3e-3 + 4e6 * 3e-8)
    assert net.collective("all_reduce", 4e6, Group(1, 1)) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        net.collective("broadcast", 1.0, g)


def test_missing_fits_are_named():
    gpu = proxy_gpu(Fit(1e-5, 1e-9))
    link = Link("l", 1.0, 1.0, 1.0, (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), 1.0)
    with pytest.raises(ValueError, match="allreduce"):
        ProxyNet(Cluster(gpu, link, link, 2, 1, 1, 0.0), {"hop": HOP, "allgather": AG})


def test_proxy_gpu_prices_an_add_as_measured():
    add = Fit(2e-5, 1e-9)  # 20 us + 1 ns per fp32 element
    gpu = proxy_gpu(add)
    link = Link("l", 1.0, 1.0, 1.0, (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), 1.0)
    env = Env(Cluster(gpu, link, link, 2, 1, 1, 0.0), "fp32", TableGemm(gpu, "fp32", {(1, 1, 1): 1.0}),
              _net(2))
    assert env.add(1e6) == pytest.approx(2e-5 + 1e6 * 1e-9)  # Env.add: one fp32 add of 1e6 elements


def test_link_fit_takes_the_sustained_rate_and_the_smallest_fixed_cost():
    # a shaped link: the two small sizes pass inside the burst (no rate), the two large ones pay it
    f = link_fit([(2000, 1e-3), (1000, 2e-3), (10000, 5e-3), (20000, 9e-3)])
    assert f.per_byte == pytest.approx((9e-3 - 5e-3) / (20000 - 10000))  # 4e-7 s per byte
    assert f.alpha == pytest.approx(1e-3)  # the least of the smaller sizes' times
    with pytest.raises(ValueError, match="three"):
        link_fit([(1, 1.0), (2, 2.0)])


def _figures(nodes: int) -> dict:
    rows = [[1000, 1e-3], [10000, 2e-3], [20000, 3e-3]]  # link_fit: alpha 1e-3, 1e-7 s per byte
    stock = [[1000, 2e-3], [10000, 4e-3], [20000, 6e-3]]  # alpha 2e-3, 2e-7 s per byte
    return {"device": "host CPU (gloo)", "backend": "gloo", "dtype": "fp32", "gpus_per_node": 2, "nodes": nodes,
            "gemm": [[8, 8, 8, 1e-4]], "intra": rows, "inter": rows if nodes > 1 else [],
            "stock": {"all_gather": stock, "all_reduce": stock}}


def test_probed_env_on_one_node_prices_the_probed_exchange_and_stock():
    env = probed_env(_figures(1), Fit(1e-5, 1e-9))
    g = Group(2, 2)
    assert env.net.hop(5e4, 5e4, False) == pytest.approx(1e-3 + 5e4 * 1e-7)  # the exchange's line
    assert env.net.collective("all_reduce", 5e4, g) == pytest.approx(2e-3 + 5e4 * 2e-7)
    assert env.mm(8, 8, 8) == pytest.approx(1e-4)  # the probe's GEMM row


def test_probed_env_on_two_levels_gives_the_node_link_every_local_rank_shared_in_the_probe():
    env = probed_env(_figures(2), Fit(1e-5, 1e-9))
    # the probe's inter exchange ran with both local ranks crossing at once, 1e-7 s per byte per flow: the
    # node's link moves twice that; two flows (a pairwise step) get 1e-7 each, one flow alone (a ring step) 5e-8
    assert env.net.hop(5e4, 5e4, True, senders=2) == pytest.approx(1e-3 + 5e4 * 1e-7)
    assert env.net.hop(5e4, 5e4, True, senders=1) == pytest.approx(1e-3 + 5e4 * 5e-8)
    assert env.net.hop(5e4, 5e4, False) == pytest.approx(1e-3 + 5e4 * 1e-7)  # intra: as probed
    with pytest.raises(ValueError, match="stock"):
        probed_env({k: v for k, v in _figures(1).items() if k != "stock"}, Fit(1e-5, 1e-9))


def test_a_gloo_calls_host_part_is_its_fits_alpha_and_a_gpu_calls_is_none():
    """ProxyNet.collective_fixed: the least time of one call of that kind (a reduce-scatter's: one hop's, the
    line-rate ring's first post); the GPU Net prices NCCL's call whole (0) and its host runs ahead of compute."""
    from megatron_flashoverlap.plan.links import Net

    net, g = _net(), Group(4, 4)
    assert net.host_is_compute and not Net.host_is_compute
    assert net.collective_fixed("all_gather", g) == net.collective_fixed("all_to_all", g) == AG.alpha
    assert net.collective_fixed("all_reduce", g) == AR.alpha
    assert net.collective_fixed("reduce_scatter", g) == HOP.alpha
    assert net.collective_fixed("all_gather", Group(1, 1)) == 0.0
    assert Net(net.cluster).collective_fixed("all_gather", g) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        net.collective_fixed("broadcast", g)


def test_on_the_proxy_a_sliced_all_gather_pays_its_calls_host_parts_only_where_compute_has_no_slack():
    """slicing:4 of an all-gather + GEMM on the proxy (ops.column_fwd, P = 2, slowdown 0): each call's host part
    (AG.alpha = 2 ms) runs on gloo's worker, one after another, while the previous call's bytes are on the link;
    where compute runs beside it, both share the rank's core at half speed (walk.py). Link-bound, the host parts
    hide under the bytes; compute-bound, they stretch the compute."""
    from megatron_flashoverlap.plan import ops

    gpu = proxy_gpu(Fit(1e-5, 1e-9))
    link = Link("l", 1.0, 1.0, 1.0, (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), 1.0)
    net = ProxyNet(Cluster(gpu, link, link, 2, 1, 1, 0.0), FITS)

    def times(per_row, rows):
        env = Env(net.cluster, "fp32", None, net)
        env.mm = lambda m, k, n: m * per_row  # every GEMM costs per_row seconds per output row
        t = ops.column_fwd(env, Group(2, 2), rows, 1000, 2).times
        return t["reference"], t["slicing:4"]

    # link-bound: 2000 rows x 1000 x 4 B gathered, 4e6 B per rank x 2e-8 = 80 ms of bytes; GEMM 2000 x 1 us.
    # one call (waited with nothing between: host at full speed): host 0-2 ms, bytes 2-82, GEMM 82-84. Four
    # calls posted at once: call 0's host 0-2 (waited first, nothing beside it), calls 1-3's at half speed
    # (waited later: compute beside them) 2-6, 6-10, 10-14; bytes 2-22, 22-42, 42-62, 62-82 (each after the
    # previous call's); a 0.5 ms GEMM after each wait, past every host part: the last ends 82.5
    one, four = times(1e-6, 2000)
    assert one == pytest.approx(84e-3) and four == pytest.approx(82.5e-3)
    # compute-bound: 20 rows, 4e4 B per rank (0.8 ms; 0.2 ms a quarter); GEMM 2 ms a row. One call: host 0-2,
    # bytes 2-2.8, GEMM 2.8-42.8. Four: hosts 0-2, then 2-6, 6-10, 10-14 shared; call 0 arrives at 2.2; GEMM 0
    # (10 ms) runs at half speed to 14 (5.9 ms of it), the rest by 18.1; three more 10 ms GEMMs: 48.1 ms
    one, four = times(2e-3, 20)
    assert one == pytest.approx(42.8e-3) and four == pytest.approx(48.1e-3)


def test_stock_reduce_scatter_is_priced_from_its_own_probe_rows_where_the_probe_timed_them():
    """A probe that timed stock's reduce-scatter (what dist.reduce_scatter_tensor runs: in the benchmarks a P2P
    ring on a shim thread) prices it from those rows; an older probe falls back to (P - 1) of our hops."""
    rs = Fit(4e-3, 4e-8)
    gpu = proxy_gpu(Fit(1e-5, 1e-9))
    link = Link("l", 1.0, 1.0, 1.0, (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), 1.0)
    net, g = ProxyNet(Cluster(gpu, link, link, 4, 1, 1, 0.0), {**FITS, "reducescatter": rs}), Group(4, 4)
    assert net.collective("reduce_scatter", 4e6, g) == pytest.approx(4e-3 + 1e6 * 4e-8)  # per rank 1e6 bytes out
    assert net.collective_fixed("reduce_scatter", g) == rs.alpha
    assert _net().collective("reduce_scatter", 4e6, g) == pytest.approx(3 * (1e-3 + 1e6 * 1e-8))
    rows = [[65536, 1e-3], [1 << 20, 5e-3], [4 << 20, 17e-3]]  # link_fit: alpha 1 ms, 4 ms per 3 MiB
    figures = {"gpus_per_node": 2, "nodes": 1, "gemm": [], "intra": rows,
               "stock": {"all_gather": rows, "all_reduce": rows, "reduce_scatter": rows}}
    env = probed_env(figures, Fit(1e-5, 1e-9))
    assert env.net.fits["reducescatter"].alpha == pytest.approx(1e-3)
    assert env.net.fits["reducescatter"].per_byte == pytest.approx(12e-3 / (3 << 20))
    del figures["stock"]["reduce_scatter"]
    assert "reducescatter" not in probed_env(figures, Fit(1e-5, 1e-9)).net.fits
