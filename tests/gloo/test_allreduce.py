"""Tier 2 (gloo processes): every all-reduce algorithm against torch.distributed.all_reduce and the exact sum.

Tolerance: the sum order differs from stock, so results are compared with the rounding bound of P-1
additions in the working dtype, (P-1) * u * sum_r |x_r| elementwise (mp_allreduce.py); ratio <= 1 passes.
Against stock the bound doubles (both sides round). Every rank must hold bitwise the same result.
"""
import pytest

from megatron_flashoverlap.schedules import ALL_REDUCE_SCHEDULES
from tests.support.pool import WorkerError

ALGOS = ["reference", *ALL_REDUCE_SCHEDULES]  # every word of the table: a new schedule is run here too
SMALL = [1, 2, 3, 7, 100, 1001, 4099]  # incl. sizes below and not divisible by the rank count
MB = 1 << 20


def _check(results):
    for per_rank in results:
        for c in per_rank:
            where = f"{c['algo']} numel={c['numel']}"
            assert c["ours"] <= 1.0, f"{where}: error {c['ours']:.3g} x the rounding bound"
            assert c["stock"] <= 1.0, f"stock itself off for {where}"
            assert c["vs_stock"] <= 1.0, f"{where}: differs from stock by {c['vs_stock']:.3g} x the bound"
            assert c["unchanged"] and c["replicated"] and c["shape"] and c["dtype"], where


@pytest.mark.parametrize("world,local", [(2, None), (2, 1), (3, None), (3, 1), (4, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_sizes(pools, world, local, dtype):
    _check(pools(world).run("tests.gloo.mp_allreduce:sweep", ALGOS, SMALL, dtype, local, timeout=240))


@pytest.mark.parametrize("world,local,fp32,bf16", [
    (2, 1, [MB // 4 + 3, 2 * MB], [4 * MB + 1]),  # 1 MB + 3 elements (not divisible), 8 MB exactly
    (4, 2, [2 * MB], []),
    (3, 1, [MB // 4 + 3], [MB // 2 + 1]),
])
def test_megabyte_sizes(pools, world, local, fp32, bf16):
    _check(pools(world).run("tests.gloo.mp_allreduce:sweep", ALGOS, fp32, "float32", local, timeout=300))
    if bf16:
        _check(pools(world).run("tests.gloo.mp_allreduce:sweep", ALGOS, bf16, "bfloat16", local, timeout=300))


@pytest.mark.parametrize("world,local", [(6, 2), (8, 2), (6, 1)])
def test_halving_doubling_across_more_than_two_nodes(pools, world, local):
    # 3 and 4 nodes (3: the fold), and 6 nodes of one rank; fp32 and bf16, sizes not divisible by the blocks
    algos = ["hierarchical_hd", "hierarchical"]
    _check(pools(world).run("tests.gloo.mp_allreduce:sweep", algos, [1, 7, 4099], "float32", local, timeout=240))
    _check(pools(world).run("tests.gloo.mp_allreduce:sweep", algos, [1001], "bfloat16", local, timeout=240))


@pytest.fixture(scope="module", autouse=True)
def _close_the_large_pools(pools):
    """5 and 6 workers serve this module only; they go at its end, not after each case (a start-up of 6 costs
    ~12 s on 2 cores). The 8 stay for tests/gloo/test_allreduce_layout.py, which closes them."""
    yield
    for world in (5, 6):
        pools(world).close()


@pytest.mark.parametrize("world,local", [(5, 1), (6, 2), (6, 3)])
def test_non_power_of_two_groups(pools, world, local):
    for dtype in ("float32", "bfloat16"):
        _check(pools(world).run("tests.gloo.mp_allreduce:sweep", ALGOS, [1, 6, 1001, 65537], dtype, local,
                                timeout=300))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eight_ranks_two_and_four_nodes(pools, dtype):
    for local in (2, 4):
        _check(pools(8).run("tests.gloo.mp_allreduce:sweep", ALGOS, [1, 13, 40000], dtype, local, timeout=400))
    if dtype == "float32":  # 8 MB once: hierarchical on 4 nodes x 2 ranks
        _check(pools(8).run("tests.gloo.mp_allreduce:sweep", ["hierarchical"], [2 * MB], dtype, 2, timeout=400))


@pytest.mark.parametrize("algo", ALGOS)
def test_shape_is_kept(pools, algo):
    for shape, err, scale in pools(2).run("tests.gloo.mp_allreduce:shaped", algo, (1, 3, 5)):
        assert shape == (1, 3, 5)
        assert err <= 2 * 2.0 ** -24 * scale  # one fp32 add per element, rounded on either side


@pytest.mark.parametrize("algo", ["ring", "hierarchical", "reference"])
def test_backward_is_identity(pools, algo):
    assert all(pools(2).run("tests.gloo.mp_allreduce:autograd_identity", algo))


def _table(world, local, rows):
    return {"tables": [{"world_size": world, "local_world_size": local, "backend": "gloo", "dtype": "float32",
                        "rows": rows}]}


# measured-table fixtures for the selector: ours faster at 8 KB, slower at 4 MB
ROWS = [{"bytes": 8192, "stock_us": 900.0, "ring_us": 1200.0, "recursive_doubling_us": 500.0,
         "hierarchical_us": 600.0},
        {"bytes": 4 * MB, "stock_us": 9000.0, "ring_us": 9500.0, "recursive_doubling_us": 20000.0,
         "hierarchical_us": 9900.0}]


@pytest.mark.parametrize("shape,table_layout,ours", [
    ((1, 2, 1024), (2, 2), True),      # decode-shaped, 8 KB, inside the window where ours won
    ((8, 2, 1024), (2, 2), False),     # prefill-shaped: stock
    ((1, 2, 512 * 1024), (2, 2), False),  # 4 MB: stock won there
    ((1, 2, 4 * MB), (2, 2), False),   # 32 MB: outside the measured sizes, no extrapolation
    ((1, 2, 1024), (4, 2), False),     # a table for another layout: stock
])
def test_auto_follows_the_table(pools, shape, table_layout, ours):
    table = _table(*table_layout, ROWS)
    for ran_ours, correct in pools(2).run("tests.gloo.mp_allreduce:auto_choice", table, shape):
        assert ran_ours is ours and correct


@pytest.mark.parametrize("kind,msg", [("int", "float32, bfloat16"), ("algo", "choose one of"),
                                      ("layout", "ranks per node")])
def test_bad_input_names_the_fix(pools, kind, msg):
    with pytest.raises(WorkerError, match=msg):
        pools(2).run("tests.gloo.mp_allreduce:bad_input", kind)
