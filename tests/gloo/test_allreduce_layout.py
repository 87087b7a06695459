"""Tier 2 (8 gloo processes): all_reduce(algo="auto") on subgroups of sizes 2-6 with LOCAL_WORLD_SIZE 2, 4, 8.

The node layout comes from the group's global ranks (node = global rank // LOCAL_WORLD_SIZE). A test table
makes hierarchical the fastest for every balanced (world_size, G), so "auto" must run hierarchical with the
derived G where the layout is node-contiguous and balanced, and stock (one log line) where it is not, never
raising. Explicit algo="hierarchical" raises a ValueError naming why on the layouts that forbid it.
Tolerance: (P-1) * u * sum_r |x_r| elementwise, the rounding bound of P-1 fp32 additions in any order.
"""
import pytest

GROUPS = [[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [1, 2, 3], [0, 2, 4, 6],
          [2, 3, 4, 5, 6, 7]]
LOCAL_SIZES = [2, 4, 8]

# G (group ranks per node) by hand from node = global // L, None = unbalanced; per LOCAL_WORLD_SIZE 2, 4, 8
EXPECTED_G = {
    (0, 1): (2, 2, 2),
    (0, 1, 2): (None, 3, 3),                # L=2: nodes 0,0,1
    (0, 1, 2, 3): (2, 4, 4),
    (0, 1, 2, 3, 4): (None, None, 5),       # L=2: 2,2,1 per node; L=4: 4,1
    (0, 1, 2, 3, 4, 5): (2, None, 6),       # L=4: 4,2
    (1, 2, 3): (None, 3, 3),                # L=2: nodes 0,1,1
    (0, 2, 4, 6): (1, 2, 4),                # L=2: one rank per node
    (2, 3, 4, 5, 6, 7): (2, None, 6),       # L=4: nodes 0,0,1,1,1,1
}


def _posts_on_rank0(world, g):
    """Hierarchical steps posted by group rank 0: ring RS + AG inside the node, 2(G-1), plus recursive doubling
    over N = world / G nodes: log2 N for a power of two; else node 0 is folded (hands up, gets back): 2."""
    n = world // g
    inter = 0 if n == 1 else (n.bit_length() - 1 if n & (n - 1) == 0 else 2)
    return 2 * (g - 1) + inter


def _tables():
    """hierarchical fastest at every size for every balanced layout of 2-6 ranks (gloo, float32)."""
    rows = [{"bytes": b, "stock_us": 100.0, "ring_us": 50.0, "recursive_doubling_us": 40.0, "hierarchical_us": 1.0}
            for b in (4, 1 << 20)]
    return {"tables": [{"world_size": w, "local_world_size": g, "backend": "gloo", "dtype": "float32",
                        "rows": rows} for w in range(2, 7) for g in range(1, w + 1) if w % g == 0]}


@pytest.fixture(scope="module")
def cases(pools):
    try:
        per_rank = pools(8).run("tests.gloo.mp_allreduce_layout:auto_on_subgroups", GROUPS, LOCAL_SIZES, _tables(),
                                timeout=600)
    finally:
        pools(8).close()  # 8 processes on a 2-core box: don't keep them for the session
    return [c for rank_cases in per_rank for c in rank_cases]


def test_every_case_ran_on_every_member(cases):
    want = sorted((tuple(g), lws) for g in GROUPS for lws in LOCAL_SIZES for _ in g)
    assert sorted((tuple(c["group"]), c["lws"]) for c in cases) == want


def test_auto_is_correct_and_never_raises(cases):
    for c in cases:
        where = f"group {c['group']} LOCAL_WORLD_SIZE={c['lws']}"
        assert c["auto"] <= 1.0, f"{where}: error {c['auto']:.3g} x the rounding bound"
        assert c["same_again"] and c["unchanged"] and c["shape"] == (1, 2, 5), where


def test_auto_runs_hierarchical_with_the_derived_layout_else_stock(cases):
    for c in cases:
        g = EXPECTED_G[tuple(c["group"])][LOCAL_SIZES.index(c["lws"])]
        where = f"group {c['group']} LOCAL_WORLD_SIZE={c['lws']} (G={g})"
        if g is None:
            assert c["posts"] == 0, f"{where}: the layout forbids hierarchical, auto must run stock"
        elif c["group_rank"] == 0:
            assert c["posts"] == _posts_on_rank0(len(c["group"]), g), where
        else:
            assert c["posts"] > 0 or g == len(c["group"]) == 1, where


def test_stock_fallback_is_logged_once(cases):
    for c in cases:
        g = EXPECTED_G[tuple(c["group"])][LOCAL_SIZES.index(c["lws"])]
        assert c["logs"] == (1 if g is None else 0), f"group {c['group']} LOCAL_WORLD_SIZE={c['lws']}: {c['logs']}"


def test_hierarchical_raises_naming_why_where_the_layout_forbids_it(cases):
    for c in cases:
        g = EXPECTED_G[tuple(c["group"])][LOCAL_SIZES.index(c["lws"])]
        where = f"group {c['group']} LOCAL_WORLD_SIZE={c['lws']}"
        if g is None:
            assert c["hier"] is None and "unequal rank counts" in c["hier_error"], where
            assert "local_world_size=" in c["hier_error"] and "ring" in c["hier_error"], where  # the fix
        else:
            assert c["hier_error"] == "" and c["hier"] <= 1.0, where
