"""Tier 3 (Megatron on gloo, P = 2): our column and row linears under --fp8-format hybrid --fp8-recipe tensorwise runs FP8,
whatever its algorithm: flash, slicing, reference, and auto's stock pick, which under FP8 is our FP8 reference
(Megatron's local forward has no FP8). Bodies: tests/megatron/mp_fp8_layers.py.

Tolerances: the column's y equal to the plain-torch recipe bit for bit (one scaled GEMM per output row, no
cross-rank sum); the row's y within 2 bf16 roundings (2^-7) of the fp64 sum of the recipe's fp32 partials (they
travel and sum in bf16); its dx bit for bit (one scaled GEMM per gathered dy slice); dW against the recipe 2^-7
(the flash ring's wgrad slices are summed in another order in fp32, then rounded to bf16); the FP8 result
differs from the bf16 GEMM by more than 1e-3 (so a layer that silently ran bf16 fails).
"""
import pytest

BODY = "tests.megatron.mp_fp8_layers"


@pytest.mark.parametrize("flash, ran", [
    ({"default": {"algo": "flash"}}, "flash (FP8 hybrid tensorwise)"),
    ({"default": {"algo": "slicing", "num_chunks": 2}}, "slicing (FP8 hybrid tensorwise)"),
    ({"default": {"algo": "reference"}}, "reference (FP8 hybrid tensorwise; layer fc1 runs algo 'reference')"),
    ({"default": {"algo": "auto"}, "choices": {"pinned": {"fc1/train/64": "reference"}}}, "auto (FP8 hybrid tensorwise)"),
    ({"default": {"algo": "auto"}}, "auto (FP8 hybrid tensorwise)"),  # measured: both candidates in FP8
], ids=["flash", "slicing", "reference", "auto_stock", "auto_measured"])
def test_an_fp8_column_runs_the_recipe_at_every_algorithm(pools, flash, ran):
    for res in pools(2).run(f"{BODY}:column", flash, timeout=300):
        assert res["y_is_recipe"], res
        assert res["y_vs_bf16"] > 1e-3  # FP8, not the bf16 GEMM
        assert res["dw_vs_recipe"] <= 2 ** -7
        assert res["dx_shape"] == (32, 2, 32) and res["dx_finite"]
        assert res["ran"] == ran
        if "choices" in flash:
            assert res["decided"] == {"fc1/train/64": "reference"}
        elif flash["default"]["algo"] == "auto":
            assert set(res["decided"]) == {"fc1/train/64"} and res["decided"]["fc1/train/64"] in ("reference", "flash")


@pytest.mark.parametrize("flash, ran", [
    ({"default": {"algo": "flash"}}, "flash (FP8 hybrid tensorwise)"),
    ({"default": {"algo": "reference"}}, "reference (FP8 hybrid tensorwise; layer fc2 runs algo 'reference')"),
    ({"default": {"algo": "auto"}, "choices": {"pinned": {"fc2/train/128": "reference"}}}, "auto (FP8 hybrid tensorwise)"),
], ids=["flash", "reference", "auto_stock"])
def test_an_fp8_row_runs_the_recipe(pools, flash, ran):
    for res in pools(2).run(f"{BODY}:row", flash, timeout=300):
        assert res["y_vs_recipe"] <= 2 ** -7 and res["y_vs_bf16"] > 1e-3, res
        assert res["dx_is_recipe"] and res["dw_vs_recipe"] <= 2 ** -7, res
        assert res["bias_is_param"] and res["ran"] == ran


@pytest.mark.parametrize("algo, ran", [
    ("flash", ("flash (all-reduce, no SP; FP8 hybrid tensorwise)",) * 2),
    ("reference", tuple(f"reference (FP8 hybrid tensorwise; layer {s} runs algo 'reference')" for s in ("fc1", "fc2"))),
])
def test_without_sp_both_layers_run_fp8(pools, algo, ran):
    for res in pools(2).run(f"{BODY}:no_sp", algo, timeout=300):
        assert res["h_is_recipe"] and res["y_finite"] and res["shape"] == (32, 2, 32)
        assert res["ran"] == ran
        # an inference step of the row (the chooser's decode all-reduce, prefill's pick; no dW, so one token needs
        # no multiple of 16) runs the same FP8 GEMM as the training forward of the same x: within one bf16
        # rounding (the two partials summed on another path)
        assert set(res["steps"]) == {"decode", "prefill"} and max(res["steps"].values()) <= 2 ** -7, res["steps"]


def test_the_delayed_recipe_casts_with_the_last_steps_amax_and_its_state_is_checkpointed(pools):
    for res in pools(2).run(f"{BODY}:delayed", timeout=300):
        assert res["steps_match_recipe"] == [True, True]  # the forward's bits, each step
        assert res["resumed"] and res["fresh_after_none"] == [1.0, 1.0, 1.0]
        assert res["stock_state"] is None  # tensorwise keeps no state: Megatron's own None


def test_a_forward_stock_would_run_without_fp8_is_refused(pools):
    for text in pools(2).run(f"{BODY}:refused_stock_forward", timeout=300):
        assert text is not None and "gather_output" in text and "without FP8" in text and "drop --fp8-format" in text
