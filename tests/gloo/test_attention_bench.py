"""The attention blocks handed to the benchmark harness compute the same thing under every method.

Tier: numerics (2 gloo processes). Worker body in tests/gloo/mp_attention_bench.py.
"""
BODY = "tests.gloo.mp_attention_bench:blocks_agree"


def test_query_split_block_methods_agree(pools):
    methods = [("stock", "reference", None), ("slicing k=2", "slicing", 2), ("flash", "flash", None),
               ("flash_bidir", "flash_bidir", None)]
    for kind in ("qsa", "qsa_zigzag"):
        for r in pools(2).run(BODY, kind, methods, timeout=300):
            assert max(r.values()) <= 1e-4, r  # fp32, reordered sums (RS ring order, per-block GEMMs)


def test_ulysses_block_methods_agree(pools):
    for r in pools(2).run(BODY, "ulysses", [("stock", "reference", None), ("flash", "flash", None)], timeout=300):
        assert r.pop("comm_shape_ok")
        assert max(r.values()) <= 1e-4, r  # fp32, proj summed per head group in the fused path
