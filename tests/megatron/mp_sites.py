"""Worker-side bodies of tests/megatron/test_sites.py: a tiny GPT built as Megatron's GPT builders build it (our
spec for the decoder; MTP from stock's get_gpt_mtp_block_spec, as both builders do whatever --spec says), and the
GEMM sites line every rank computes for it (megatron/sites.py: one collective over the pipeline group)."""
from __future__ import annotations

import torch

from megatron_flashoverlap.megatron import models as tm
from tests.megatron.mp_structure import moe_config


def _mtp_spec(cfg):
    """What Megatron-LM 0.19's builders pass as mtp_block_spec: stock's local spec of the last decoder layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    last = get_gpt_decoder_layer_specs(cfg, use_transformer_engine=False)[-1]
    return get_gpt_mtp_block_spec(cfg, last, use_transformer_engine=False)


def _gpt(cfg, spec, mtp=False, pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(1)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=tm.VOCAB, max_sequence_length=tm.SEQ,
                    mtp_block_spec=_mtp_spec(cfg) if mtp else None, pre_process=pre_process,
                    post_process=post_process)


def tp_line(rank, world, sp, mtp, query_split=False):
    """TP = world, dense GPT from flashoverlap_layer_spec (MTP layers: stock's spec; attention.query_split as
    given) -> the sites line."""
    from megatron_flashoverlap import config as fc
    from megatron_flashoverlap.megatron.sites import sites_line
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    tm.init_tp(world)
    previous = fc.activate(fc.from_dict({"attention": {"query_split": query_split}}))
    try:
        cfg = tm.tiny_config(world, sp, mtp_num_layers=1 if mtp else None)
        return sites_line(_gpt(cfg, flashoverlap_layer_spec(cfg), mtp))
    finally:
        fc.activate(previous)
        tm.destroy()


def pp_line(rank, world):
    """PP = world (one layer per stage, MTP on the last): every rank's line covers every stage."""
    from megatron.core import parallel_state

    from megatron_flashoverlap.megatron.sites import sites_line
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer

    tm.cpu.enable()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    try:
        cfg = tm.tiny_config(1, False, pipeline_model_parallel_size=world, pipeline_dtype=torch.float32,
                             num_layers=world, mtp_num_layers=1)
        last = rank == world - 1
        return sites_line(_gpt(cfg, flashoverlap_layer, mtp=last, pre_process=rank == 0, post_process=last))
    finally:
        tm.destroy()


def moe_line(rank, world, algo):
    """EP = world, TP = 1, --moe-layer-freq [0, 1], moe.algo `algo` -> the sites line."""
    from megatron_flashoverlap.config import activate, from_dict
    from megatron_flashoverlap.megatron.sites import sites_line
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec
    from tests.megatron.mp_structure import _init

    _init(1, None, ep=world)
    previous = activate(from_dict({"moe": {"algo": algo}}))
    try:
        cfg = moe_config(ep=world, moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=32)
        return sites_line(_gpt(cfg, flashoverlap_layer_spec(cfg)))
    finally:
        activate(previous)
        tm.destroy()


def shared_overlap_reasons(rank, world):
    """The stock reason our linear gives as a shared expert under --moe-shared-expert-overlap (Megatron's
    SharedExpertMLP sets explicit_expert_comm on it), and as a routed expert (is_expert), TP = world."""
    import types

    from megatron_flashoverlap.megatron.linear import FlashColumnParallelLinear
    from megatron_flashoverlap.config import OpPlan

    def layer(is_expert):
        return types.SimpleNamespace(flash_plan=OpPlan("flash"), flash_site="fc1", tp_group=None,
                                     explicit_expert_comm=True, is_expert=is_expert, sequence_parallel=True,
                                     config=types.SimpleNamespace(moe_shared_expert_overlap=True))
    return [FlashColumnParallelLinear._stock_reason(layer(e)) for e in (False, True)]
