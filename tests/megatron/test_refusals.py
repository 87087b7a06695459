"""Each check of the wing raises its rows' own message (config/refusals.py), called as Megatron calls it.

Tier 1 (in-process, both lanes): for every row and every check that reads it, the site, given the facts that make
the row hold (tests/pure/test_refusals.py CASES), raises "<where>: <the flag as typed> <reason>; <fix>" of that
row, so no site keeps a message of its own and none reads the wrong check. Checks not called here: `entry` (inside
megatron_flashoverlap.pretrain_gpt's run, after Megatron parses) and the query-split CP row (the CP group's size:
1 without a process group); tests/pure/test_refusals.py checks that the wing reads them.
"""
from types import SimpleNamespace

import pytest

from megatron_flashoverlap.config.refusals import said
from tests.pure.test_refusals import CASES


def _ulysses(cp_comm_type=None, **facts):
    from megatron_flashoverlap.megatron.attention import UlyssesDotProductAttention

    UlyssesDotProductAttention(SimpleNamespace(**facts), 1, None, "self", cp_comm_type=cp_comm_type)


def _query_split(**facts):
    from megatron_flashoverlap.megatron.query_split_pair import QuerySplitDotProductAttention

    from megatron_flashoverlap.config import from_dict

    groups = SimpleNamespace(tp=object(), cp=object())  # group_info: (0, 1) without torch.distributed
    QuerySplitDotProductAttention(SimpleNamespace(**facts), 1, None, "self", pg_collection=groups,
                                  flash_config=from_dict({"attention": {"query_split": True}}))  # asked for


def _parse(**facts):
    from megatron_flashoverlap.megatron.cli.args import apply_flash_overlap_args

    apply_flash_overlap_args(SimpleNamespace(flash_overlap=True, flash_overlap_config=None, **facts))


def _spec(**facts):
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    flashoverlap_layer_spec(SimpleNamespace(num_layers=2, pipeline_model_parallel_size=1, **facts))


def _local_spec(**facts):
    from megatron_flashoverlap.spec import get_gpt_layer_flashoverlap_spec

    get_gpt_layer_flashoverlap_spec(**facts)


def _linear(**facts):
    from megatron_flashoverlap.megatron.linear import FlashColumnParallelLinear

    bare = FlashColumnParallelLinear.__new__(FlashColumnParallelLinear)  # _flash_init checks before it sets up
    bare._flash_init(SimpleNamespace(**facts), None, "qkv")


def _moe(**facts):
    from megatron_flashoverlap.megatron.moe.layer import check_moe_config

    check_moe_config(SimpleNamespace(**facts))


def _norm(**facts):
    from megatron_flashoverlap.megatron.norm import check_norm_config

    check_norm_config(SimpleNamespace(**facts))


def _sdpa(**facts):
    from megatron_flashoverlap.megatron.sdpa import check_sdpa_config

    check_sdpa_config(SimpleNamespace(**facts))


def _dp(**facts):
    from megatron_flashoverlap.megatron.ddp.pretrain import refuse_unfusable

    refuse_unfusable("all", facts["use_distributed_optimizer"], facts["overlap_grad_reduce"])


# check word -> (the site as Megatron calls it, the `where` its message starts with)
SITES = {"parse": (_parse, "--flash-overlap"), "spec": (_spec, "flashoverlap_layer_spec"),
         "local_spec": (_local_spec, "get_gpt_layer_flashoverlap_spec"),
         "linear": (_linear, "FlashColumnParallelLinear"), "moe": (_moe, "flash-overlap MoE"),
         "norm": (_norm, "SequenceParallelNorm"), "ulysses": (_ulysses, "UlyssesDotProductAttention"),
         "query_split": (_query_split, "QuerySplitDotProductAttention"), "sdpa": (_sdpa, "SdpaDotProductAttention"),
         "dp": (_dp, "dp: {fuse: all} in the flash-overlap config")}
RAISING = [(at, row, facts) for at, row, facts in CASES if at in SITES
           and not (at == "query_split" and row.field == "context_parallel_size")]


@pytest.mark.parametrize("at, row, facts", RAISING, ids=[f"{a}:{r.flag}" for a, r, _ in RAISING])
def test_each_site_raises_its_rows_message(clean_config, at, row, facts):
    site, where = SITES[at]
    with pytest.raises(ValueError) as err:
        site(**facts)
    assert str(err.value) == f"{where}: {said(row, facts[row.name(at)])}; {row.fix}"


FALLBACK = [c for c in CASES if c[0] == "stock_attention"]


@pytest.mark.parametrize("at, row, facts", FALLBACK, ids=[r.flag for _, r, _ in FALLBACK])
def test_the_attention_fallback_logs_its_rows_reason(at, row, facts):
    """Not a refusal: the SDPA / query-split attentions build Megatron's DotProductAttention, saying why."""
    from megatron_flashoverlap.megatron.sdpa import unsupported_by_ours

    assert unsupported_by_ours(SimpleNamespace(**facts)) == said(row, facts[row.field])
    assert unsupported_by_ours(SimpleNamespace()) is None


def test_ddp_stays_stock_naming_the_missing_flag():
    """Under dp: {fuse: auto} the same rows are the logged reason a DDP chunk is built stock."""
    from megatron_flashoverlap.megatron.ddp.pretrain import why_stock

    assert why_stock(SimpleNamespace(use_distributed_optimizer=True, overlap_grad_reduce=False), {}).startswith(
        "without --overlap-grad-reduce, ")


QUERY_SPLIT = [(row, facts) for at, row, facts in CASES if at == "query_split" and row.field != "context_parallel_size"]


@pytest.mark.parametrize("row, facts", QUERY_SPLIT, ids=[r.flag for r, _ in QUERY_SPLIT])
def test_under_auto_a_query_split_row_is_the_reason_query_split_is_no_candidate(clean_config, row, facts):
    # attention.query_split auto (the default) refuses nothing: the row's text says why proj's auto leaves query
    # split out; a model none holds for keeps it (TP 2 with SP at CP 1, proj auto)
    from megatron_flashoverlap.megatron.query_split_pair import query_split_cannot_run

    config = clean_config.from_dict({})
    assert query_split_cannot_run(SimpleNamespace(sequence_parallel=True, **facts), config, 2, 1) == \
        said(row, facts[row.name("query_split")])
    assert query_split_cannot_run(SimpleNamespace(sequence_parallel=True), config, 2, 1) is None
    assert "sequence parallelism" in query_split_cannot_run(SimpleNamespace(sequence_parallel=False), config, 2, 1)
    assert "sequence parallelism" in query_split_cannot_run(SimpleNamespace(sequence_parallel=True), config, 1, 1)
    pinned = clean_config.from_dict({"proj": {"algo": "flash"}})
    assert "proj's algo is flash" in query_split_cannot_run(SimpleNamespace(sequence_parallel=True), pinned, 2, 1)
