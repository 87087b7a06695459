"""Worker-side body of the decode test: greedy generation with Megatron's StaticInferenceContext (KV cache)
over a tiny GPTModel, TP without SP, stock local spec vs our spec whose row-parallel linears all-reduce
with `all_reduce(algo=...)` after the local GEMM (the selector for "auto").

`DecodeRowParallelLinear._forward_without_sp` is the row-parallel hook this test defines: it is exactly
what FlashRowParallelLinear's non-SP hook should run (see /work/notes/allreduce.md).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_flashoverlap import all_reduce
from megatron_flashoverlap.ops.all_reduce.select import set_calibration
from megatron_flashoverlap.megatron import models as tm
from tests.support import profile

PROMPT, NEW = 6, 6


def _decode_row_class():
    from megatron_flashoverlap.megatron.linear import FlashRowParallelLinear

    class DecodeRowParallelLinear(FlashRowParallelLinear):
        all_reduce_algo = "auto"

        def _forward_without_sp(self, input_):
            """input_ [s, b, k/P] -> (output [s, b, h], bias or None): GEMM, then our all-reduce."""
            output = all_reduce(F.linear(input_, self.weight), self.tp_group, algo=self.all_reduce_algo,
                                context=self.flash_context)
            if self.skip_bias_add:
                return output, self.bias
            return (output + self.bias if self.bias is not None else output), None

    return DecodeRowParallelLinear


def _our_spec(algo: str):
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_flashoverlap.megatron.spec import layer_spec, submodules_of

    cls = _decode_row_class()
    cls.all_reduce_algo = algo
    spec = layer_spec()
    submodules_of(spec.submodules.self_attention).linear_proj = ModuleSpec(module=cls)
    submodules_of(spec.submodules.mlp).linear_fc2 = ModuleSpec(module=cls)
    return spec


def _step(model, tokens, start, ictx):
    """logits of the last position [b, vocab] (full vocab: runtime_gather_output), KV cache advanced."""
    b, s = tokens.shape
    pos = torch.arange(start, start + s).unsqueeze(0).expand(b, s).contiguous()
    logits = model(tokens, pos, None, inference_context=ictx, runtime_gather_output=True)
    ictx.sequence_len_offset += s
    return logits[:, -1, :]


def _generate(model, prompt, new_tokens, profile_step=None):
    """Greedy: prefill the prompt, then one token per step ([1, b, h] activations). -> tokens, margin, ops."""
    from megatron.core.inference.contexts import StaticInferenceContext

    b, plen = prompt.shape
    ictx = StaticInferenceContext(b, plen + new_tokens)
    out, margins, ops = [], [], {}
    with torch.no_grad():
        last = _step(model, prompt, 0, ictx)
        for t in range(new_tokens):
            top = last.topk(2, dim=-1).values
            margins.append((top[:, 0] - top[:, 1]).min().item())
            nxt = last.argmax(-1, keepdim=True)  # [b, 1]
            out.append(nxt)
            if t == new_tokens - 1:
                break
            if t == profile_step:
                ops = profile.comm_ops(lambda: None)  # warm the profiler outside the measured step
                holder = {}
                ops = profile.comm_ops(lambda: holder.setdefault("l", _step(model, nxt, plen + t, ictx)))
                last = holder["l"]
            else:
                last = _step(model, nxt, plen + t, ictx)
    return torch.cat(out, dim=1), min(margins), ops


def greedy(rank, world, algo, table=None, local_world_size=None, seed=5):
    """Tokens of stock and ours for one prompt and weights; our decode-step c10d op counts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tm.init_tp(world)
    set_calibration(table)
    if local_world_size:  # the node layout the layers' all-reduce reads (as torchrun would set it)
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    try:
        cfg = tm.tiny_config(world, sp=False)
        seq = PROMPT + NEW
        stock = tm.build_gpt(cfg, get_gpt_layer_local_spec(), seq=seq).eval()
        ours = tm.build_gpt(cfg, _our_spec(algo), seq=seq).eval()
        tm.copy_weights(ours, stock)
        prompt = tm.batch(seed, b=2, s=PROMPT)["input_ids"]
        t_stock, margin, stock_ops = _generate(stock, prompt, NEW, profile_step=1)
        t_ours, _, our_ops = _generate(ours, prompt, NEW, profile_step=1)
        same = torch.tensor([int(torch.equal(t_ours, t_stock))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        return {"stock": t_stock.tolist(), "ours": t_ours.tolist(), "margin": margin, "stock_ops": stock_ops,
                "our_ops": our_ops, "all_ranks_same": bool(same.item())}
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        set_calibration(None)
        tm.destroy()
