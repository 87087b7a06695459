"""The GEMM sites line (megatron/sites.py): what every GEMM site of every layer kind runs, and why where stock.

Tier 1 (in-process, both lanes): the line's format from a summary written by hand.
Tier 3 (gloo pool, both lanes): the line of real tiny GPTs: TP=2 with and without SP (the decomposed all-reduce
is ours, not "stock"), MTP layers built by stock's MTP spec (as Megatron's builders build them: named stock, with
the reason), PP=2 (every rank's line covers every stage), MoE at EP=2 per moe.algo.
Bodies in tests/megatron/mp_sites.py. That the launcher and the project entry print it once the model is built:
tests/megatron/test_pretrain.py and test_example.py
(a stock run's line, "GEMM sites: stock", there too).
"""
import pytest

from megatron_flashoverlap.megatron.sites import MTP_STOCK, format_line

BODY = "tests.megatron.mp_sites"
SP4 = "qkv=auto, proj=auto, fc1=auto, fc2=auto"  # the default config's word
NOSP = "(all-reduce, no SP)"
TP1 = "stock (tensor-parallel size 1)"


def test_line_format():
    summary = {"ours": True, "kinds": {
        "mtp": {"layers": {1}, "sites": {"eh_proj": {"stock (x)"}, "qkv": {"stock (x)"}}},
        "moe": {"layers": {2, 4}, "sites": {"experts": {"stock (y)"}, "proj": {"flash"}, "qkv": {"flash"},
                                            "ep_a2a": {"exchange"}}},
        "dense": {"layers": {1, 3, 5, 6, 7}, "sites": {"fc2": {"flash", "stock (z)"}, "qkv": {"slicing"}}}}}
    assert format_line(summary) == ("GEMM sites: dense[1,3,5-7]: qkv=slicing, fc2=flash/stock (z); "
                                    "moe[2,4]: qkv=flash, proj=flash, ep_a2a=exchange, experts=stock (y); "
                                    "mtp[1]: stock (x)")
    assert format_line({"ours": False, "kinds": summary["kinds"]}) == "GEMM sites: stock"


@pytest.mark.parametrize("sp, mtp, expected", [
    (True, False, f"GEMM sites: dense[1-2]: {SP4}"),
    (False, False, f"GEMM sites: dense[1-2]: qkv=auto {NOSP}, proj=auto {NOSP}, fc1=auto {NOSP}, fc2=auto {NOSP}"),
    (True, True, f"GEMM sites: dense[1-2]: {SP4}; mtp[1]: stock ({MTP_STOCK})"),
], ids=["sp", "no_sp", "sp_mtp"])
def test_tp_line(pools, sp, mtp, expected):
    assert pools(2).run(f"{BODY}:tp_line", sp, mtp, timeout=300) == [expected] * 2


def test_query_split_names_its_operator_at_proj(pools):
    # attention.query_split with the default auto: proj runs attention + proj + RS as one operator, its algo
    # chosen at the first training step; stock's attention config, so no fallback to Megatron's attention
    expected = "GEMM sites: dense[1-2]: qkv=auto, proj=query_split (auto), fc1=auto, fc2=auto"
    assert pools(2).run(f"{BODY}:tp_line", True, False, True, timeout=300) == [expected] * 2


@pytest.mark.parametrize("sp, expected", [
    (True, "GEMM sites: dense[1-2]: qkv=auto, proj=auto (query_split a candidate), fc1=auto, fc2=auto"),
    (False, f"GEMM sites: dense[1-2]: qkv=auto {NOSP}, proj=auto {NOSP}, fc1=auto {NOSP}, fc2=auto {NOSP}"),
], ids=["sp", "no_sp"])
def test_the_default_query_split_auto_says_where_proj_weighs_it(pools, sp, expected):
    # attention.query_split auto (the default): under SP proj's auto has query split among its candidates;
    # without SP the pair is not built (Megatron's DotProductAttention, proj as without it)
    assert pools(2).run(f"{BODY}:tp_line", sp, False, "auto", timeout=300) == [expected] * 2


def test_pipeline_stages_are_gathered(pools):
    expected = f"GEMM sites: dense[1-2]: {TP1}; mtp[1]: stock ({MTP_STOCK})"
    assert pools(2).run(f"{BODY}:pp_line", timeout=300) == [expected] * 2


@pytest.mark.parametrize("algo, exchange", [
    ("flash", "ep_a2a=flash (fused with the experts), experts=stock (Megatron's SequentialMLP, run per arriving "
              "block inside the fused exchange)"),
    ("exchange", "ep_a2a=exchange, experts=stock (Megatron's SequentialMLP, after the exchange)"),
    ("reference", "ep_a2a=stock (moe.algo 'reference': all_to_all_single), experts=stock (Megatron's SequentialMLP, "
                  "after the exchange)"),
])
def test_moe_line(pools, algo, exchange):
    shared = f"qkv={TP1}, proj={TP1}, shared_fc1={TP1}, shared_fc2={TP1}"
    expected = f"GEMM sites: dense[1]: {TP1}; moe[2]: {shared}, {exchange}"
    assert pools(2).run(f"{BODY}:moe_line", algo, timeout=300) == [expected] * 2


def test_shared_experts_under_shared_expert_overlap_get_their_own_reason(pools):
    shared, routed = pools(2).run(f"{BODY}:shared_overlap_reasons", timeout=120)[0]
    assert shared.startswith("--moe-shared-expert-overlap: Megatron's shared expert runs its own all-gather"), shared
    assert routed == "expert / GTP-remat layer"
