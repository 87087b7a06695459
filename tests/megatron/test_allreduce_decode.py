"""Tier 3 (Megatron on gloo): greedy decode through our row-parallel all-reduce gives stock's tokens.

A tiny GPTModel (2 layers, fp32, TP without SP) generates with Megatron's StaticInferenceContext (KV
cache): prefill [s, b, h], then one token per step, [1, b, h] activations: decode-shaped, so the shipped
row-parallel layer (FlashRowParallelLinear -> matmul_all_reduce) runs its decode branch there: the GEMM,
then all_reduce(algo) ("auto": ours from a calibration table that says ours is faster at these sizes).
Tokens must equal stock's exactly; the sum order differs (fp32, ~1e-6 relative), so the test also checks
the top-2 logit gap stayed far above that (a tie could not have hidden a difference) and the logits of every
step against stock's within LOGITS.
"""
import pytest

# fp32; per step the row-parallel all-reduces sum P partials in another order than stock's (and prefill runs
# the decomposed all-reduce): ~1e-7 relative per sum, through 2 layers and the output GEMM; a 1e-3 relative
# defect in the decode all-reduce (mutation decode_all_reduce_off_by_a_permille) moves them ~1e-3
LOGITS = 1e-5


# a calibration-format table: ours (recursive doubling, then hierarchical) faster over 64 B - 64 KB
def _table(world, local):
    rows = [{"bytes": b, "stock_us": 500.0, "ring_us": 900.0, "recursive_doubling_us": 300.0,
             "hierarchical_us": 400.0 if local == world else 200.0} for b in (64, 65536)]
    return {"tables": [{"world_size": world, "local_world_size": local, "backend": "gloo", "dtype": "float32",
                        "rows": rows}]}


# (tp, algo, local_world_size, sends per row-parallel all-reduce at decode: RD log2 P; hierarchical 2x2: RS+RD+AG)
CASES = [(2, "auto", None, 1), (2, "ring", None, 2), (4, "auto", 2, 1 + 1 + 1), (4, "recursive_doubling", None, 2)]


@pytest.mark.parametrize("tp,algo,local,sends", CASES)
def test_greedy_decode_matches_stock(pools, tp, algo, local, sends):
    table = _table(tp, local or tp) if algo == "auto" else None
    results = pools(tp).run("tests.megatron.mp_allreduce_decode:greedy", algo, table, local, timeout=400)
    for res in results:
        assert res["ours"] == res["stock"] and res["all_ranks_same"]
        assert len(res["ours"][0]) == 6
        assert res["margin"] > 1e-4  # top-2 gap >> fp32 sum-order error: equal tokens are meaningful
        assert res["logits"] <= LOGITS, res["logits"]  # relative to the logits' max magnitude
        # one decode step: stock all-reduces in the embedding + 4 row-parallel linears (2 layers x proj, fc2);
        # ours leaves only the embedding's and sends P2P instead
        assert res["stock_ops"].get("all_reduce") == 5 and "send" not in res["stock_ops"]
        assert res["our_ops"].get("all_reduce") == 1
        assert res["our_ops"].get("send") == 4 * sends
