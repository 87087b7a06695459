"""Tier 3 (Megatron on gloo): prefill of any prompt length. GPTModel with TP = 2 and 4 without sequence
parallelism, sequence lengths TP does not divide: our layers run the decomposed all-reduce on the input
zero-padded to a multiple of TP (counted), never a plain all-reduce, and match the stock local spec.
Tolerances (fp32), as the divisible lengths (test_tp_nosp_gpt.py): logits and loss 1e-6 relative (the ring adds
the same partials in another order at P > 2; GEMMs cut in row slices); grads 1e-5 relative per parameter."""
import pytest


@pytest.mark.parametrize("tp,lengths", [(2, (7, 5)), (4, (7, 6))])
def test_gpt_prefill_any_length_runs_decomposed_and_matches_stock(pools, tp, lengths):
    for per_s in pools(tp).run("tests.megatron.mp_prefill_uneven:gpt_any_length", tp, lengths, timeout=600):
        for s, r in per_s.items():
            assert r["padded"] > 0, f"s={s}: the decomposed all-reduce must run (padded), not a plain all-reduce"
            assert r["logits"] <= 1e-6 and r["loss"] <= 1e-6, (s, r)
            assert r["grad"] <= 1e-5, (s, r)
