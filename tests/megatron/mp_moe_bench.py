"""Worker-side body of tests/megatron/test_moe_bench.py: the MoE benchmark's three measures keep routing equal."""
from __future__ import annotations

import torch

CFG = {"tokens": 48, "hidden": 32, "ffn": 32, "experts": 4, "topk": 2, "repeats": 1}


def _splits(layer) -> tuple:
    d = layer.token_dispatcher
    return tuple(int(v) for v in d.input_splits), tuple(int(v) for v in d.output_splits)


def measures_route_alike(rank: int, world: int) -> dict:
    """Per method: split sizes of block / compute-alone / comm-alone calls, the EP group after the fake call,
    and the block output (fwd) and input grad (fwd+bwd) for a cross-method comparison."""
    from megatron.core import parallel_state

    from benchmarks.harness import timing
    from benchmarks.moe import rows as moe_rows
    from megatron_flashoverlap.megatron import cpu

    cpu.enable()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        fake = timing.fake_group(world)
        x = torch.randn(CFG["tokens"], 1, CFG["hidden"], generator=torch.Generator().manual_seed(rank))
        out = {}
        for m in moe_rows.methods():
            full, thin = moe_rows._pair(CFG, world, m)
            real = full.token_dispatcher.ep_group
            moe_rows._call(full, x, "fwd+bwd", fake)
            fake_splits, restored = _splits(full), full.token_dispatcher.ep_group is real
            xg = x.detach().requires_grad_(True)
            y = full(xg)[0]
            y.backward(torch.ones_like(y))
            block_splits = _splits(full)
            thin(x)
            out[m] = {"block": block_splits, "compute": fake_splits, "comm": _splits(thin), "restored": restored,
                      "y": y.detach(), "dx": xg.grad}
    finally:
        parallel_state.destroy_model_parallel()
    return out
