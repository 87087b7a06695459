"""Tier 2 (2-4 gloo processes): the fused expert pipeline (ops/moe/fused.py) on a plain per-expert MLP, against
outputs and gradients computed directly from the global data (mp_moe_pipeline.py), for every algo.
The numerics are those of gloo's default path, the posts on the communication thread (runtime/commthread.py);
the c10d op counts come from a second, profiled run (the profiler keeps posts in the calling thread).

Tolerances (fp32):
  y, dx, dprobs  1e-6 relative: each row goes through the same expert math once; only the GEMM kernel's
                 blocking for a different row count (one source block vs all rows) may round differently
  weight grads   1e-5 relative: flash sums P+1 per-block dW GEMMs (the own block in two halves) where the
                 expected value runs one GEMM per expert: a reordered fp32 sum
"""
import pytest

BODY = "tests.gloo.mp_moe_pipeline"


def _close(res):
    assert res["y"] <= 1e-6 and res["dx"] <= 1e-6 and res["dp"] <= 1e-6, res
    assert res["dw"] <= 1e-5, res
    assert all(n == 1 for n in res["hooks"]), f"each expert weight's grad must be accumulated once: {res['hooks']}"


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("algo", ["flash", "exchange", "reference"])
def test_pipeline_matches_expected_uneven_and_zero_counts(pools, p, algo):
    for res in pools(p).run(f"{BODY}:pipeline_vs_expected", algo, seed=p):
        _close(res)
        for when in ("fwd", "bwd"):
            ops = res["ops"][when]
            if algo == "reference":
                assert ops.get("all_to_all", 0) >= 2 and "send" not in ops, ops
            else:
                assert "all_to_all" not in ops and ops.get("send", 0) >= 1, ops
                assert res["thread_jobs"][when] >= 1, res["thread_jobs"]  # the numerics above ran on the thread


@pytest.mark.parametrize("p", [2, 3])
def test_pipeline_nothing_routed(pools, p):
    """Every count zero: nothing is posted, nothing computed, the gradients are zeros (hooks still fire once)."""
    for res in pools(p).run(f"{BODY}:pipeline_vs_expected", "flash", seed=1, zeros="all"):
        _close(res)
        assert "send" not in res["ops"]["fwd"] and "send" not in res["ops"]["bwd"], res["ops"]


@pytest.mark.parametrize("p", [2, 4])
def test_pipeline_without_zeros(pools, p):
    for res in pools(p).run(f"{BODY}:pipeline_vs_expected", "flash", seed=5, zeros="none"):
        _close(res)
        assert min(res["thread_jobs"].values()) >= 1, res["thread_jobs"]


@pytest.mark.parametrize("p", [2, 3])
def test_fused_wgrad_goes_to_main_grad_once(pools, p):
    for res in pools(p).run(f"{BODY}:fused_main_grad"):
        assert res["main_grad"] <= 1e-5, res  # main_grad holds the per-block dW summed in fp32 (see the top)
        assert all(res["flags"]) and all(n == 1 for n in res["hooks"]), res


@pytest.mark.parametrize("p", [2, 3, 4])
def test_experts_run_per_source_block_between_the_steps(pools, p):
    """Own half first, then each source block one step after it arrived while the next flies, own half last."""
    for rank, trace in enumerate(pools(p).run(f"{BODY}:walk_order")):
        computes = [b for what, b in trace if what == "compute"]
        assert computes == [rank] + [(rank - j) % p for j in range(1, p)] + [rank], trace
        under = [trace[i - 1][0] == "post" for i, (what, _) in enumerate(trace) if what == "compute"]
        # each compute runs while its step's transfers fly (posted just before it); at P=2 step 1 has no hop
        assert under == ([True, False, True] if p == 2 else [True] * (p + 1)), trace
        assert [w for w, _ in trace].count("wait") == p + 1, trace


def test_bad_counts_name_the_fix(pools):
    for msgs in pools(2).run(f"{BODY}:bad_counts"):
        assert len(msgs) == 2 and "counts must be" in msgs[0] and "input_splits" in msgs[1], msgs


def test_no_grad_forward(pools):
    for res in pools(3).run(f"{BODY}:no_grad_forward"):
        assert res["y"] <= 1e-6 and not res["requires_grad"], res  # same row math as above
