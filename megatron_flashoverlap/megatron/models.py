"""Small real Megatron-Core GPT models on CPU/gloo ranks, for examples, benchmarks and tests.

    init_tp(tp, seed)              cpu.enable() + initialize_model_parallel(tp) + model_parallel_cuda_manual_seed
    destroy()                      destroy_model_parallel() (call it in a `finally`)
    tiny_config(tp, sp, **kw)      an fp32 TransformerConfig small enough for 2 cores
    build_gpt(config, spec, ...)   GPTModel with fixed-seed init (same seed -> same weights for any spec)
    allreduce_sequence_parallel_grads(model)   what finalize_model_grads does for SP-tagged params
    copy_weights(dst, src)         load src's parameters into dst by name (the specs share names)
    batch(seed, b, s, vocab)       tokens, position ids and labels [b, s], identical on every rank
    gpt_loss(model, batch)         mean token loss (scalar), through Megatron's vocab-parallel cross-entropy
"""
from __future__ import annotations

import torch

from . import cpu

VOCAB, SEQ = 128, 16


def init_tp(tp: int, seed: int = 1234) -> None:
    """TP groups of size `tp` over the already initialized default group, RNG tracker seeded."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu.enable()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def tiny_config(tp: int, sp: bool, num_layers: int = 2, hidden: int = 32, heads: int = 4, ffn: int = 64, **kw):
    """fp32, no dropout, CPU init: the smallest GPT that still has every TP linear."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                             ffn_hidden_size=ffn, tensor_model_parallel_size=tp, sequence_parallel=sp,
                             use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
                             attention_dropout=0.0, gradient_accumulation_fusion=False, **kw)


def build_gpt(config, spec, seed: int = 7, vocab: int = VOCAB, seq: int = SEQ):
    """GPTModel built under a fixed seed (CPU init draws from torch's RNG)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq)


def copy_weights(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """dst.param[name] <- src.param[name] for every name; the names must match exactly."""
    dst.load_state_dict(src.state_dict(), strict=True)


def batch(seed: int, b: int = 2, s: int = SEQ, vocab: int = VOCAB) -> dict:
    """tokens / position_ids / labels [b, s], the same on every rank (one generator, one seed)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    return {"input_ids": tokens[:, :-1].contiguous(), "position_ids": pos.contiguous(),
            "labels": tokens[:, 1:].contiguous()}


def gpt_logits(model, data: dict) -> torch.Tensor:
    """logits [b, s, vocab/tp] (the vocab-parallel shard; default causal mask)."""
    return model(data["input_ids"], data["position_ids"], None)


def gpt_loss(model, data: dict) -> torch.Tensor:
    """Mean per-token loss over [b, s] (Megatron returns the per-token loss when labels are given)."""
    return model(data["input_ids"], data["position_ids"], None, labels=data["labels"]).float().mean()


def allreduce_sequence_parallel_grads(model: torch.nn.Module) -> int:
    """All-reduce over TP the grads of params tagged `sequence_parallel` (LayerNorms, row biases), as
    Megatron's finalize_model_grads does under SP; -> how many params. Without it SP training diverges."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    for g in grads:
        dist.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
    return len(grads)


def adam_steps(model, data: dict, steps: int, lr: float) -> list[float]:
    """`steps` Adam steps of gpt_loss on one batch, SP grads all-reduced as finalize_model_grads does;
    -> the loss before each step."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = gpt_loss(model, data)
        loss.backward()
        allreduce_sequence_parallel_grads(model)
        opt.step()
        losses.append(loss.item())
    return losses
