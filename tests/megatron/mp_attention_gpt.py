"""Worker bodies: a real Megatron GPTModel (local spec, RoPE) with Ulysses context parallelism vs the same
model without CP, trained side by side from the same initial weights on the same batches.

Phase 1 (reference): TP=tp, CP=1 (the other ranks are data-parallel replicas fed the same batch), stock
    local spec. Phase 2: TP=tp, CP=cp, the local spec with core_attention = UlyssesDotProductAttention,
    initial weights loaded from phase 1 (TP ranks coincide: Megatron's order is tp-cp-dp), batch split by
    Megatron's own `get_batch_on_this_cp_rank` (zigzag, 2*cp chunks). Grad sync as finalize_model_grads
    does it: sum over the CP (or DP) group of the replicated params, and over TP of the params tagged
    `sequence_parallel`. Plain SGD. Returns both loss curves.
`query_split_vs_stock`: TP=P with SP, the local spec vs core_attention + linear_proj = the query-split pair.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

SEQ, VOCAB = 16, 128


def _init(tp, cp, seed=1234):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_flashoverlap.megatron import cpu

    cpu.enable()  # also the CP RoPE index (pin_memory + .cuda()) on CPU
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(seed)


def _model(tp, cp, kind, heads, groups, algo="flash", dropout=0.0, hidden_dropout=0.0):
    """kind: "stock" (local spec), "ulysses" (core_attention = UlyssesDotProductAttention(algo)), "qsa"
    (core_attention + linear_proj = QuerySplit..., the proj site running `algo`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_flashoverlap.config import from_dict
    from megatron_flashoverlap.megatron import attention as la
    from megatron_flashoverlap.megatron import query_split_pair as qs
    from megatron_flashoverlap.megatron.spec import submodules_of

    kw = dict(context_parallel_size=cp, cp_comm_type="a2a") if cp > 1 else {}
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                            ffn_hidden_size=64, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                            use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=hidden_dropout,
                            attention_dropout=dropout, gradient_accumulation_fusion=False, **kw)
    if kind == "spec":
        from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

        from megatron_flashoverlap import config as fc

        query_split = {"query_split": True, "auto": "auto"}.get(algo, False)  # auto: the default config's word
        previous = fc.activate(fc.from_dict({"attention": {"query_split": query_split}}))
        try:
            spec = flashoverlap_layer_spec(cfg)
        finally:
            fc.activate(previous)
    else:
        spec = get_gpt_layer_local_spec()
    attn = submodules_of(spec.submodules.self_attention)
    if kind == "ulysses":
        own = from_dict({"attention": {"ulysses_algo": algo}})  # a config (and chooser) of its own, not the pool's
        attn.core_attention = ModuleSpec(module=la.UlyssesDotProductAttention, params={"flash_config": own})
    elif kind == "qsa":
        fc = from_dict({"default": {"algo": algo, "num_chunks": 2 if algo == "slicing" else None},
                        "attention": {"query_split": True}})  # asked for, each layer's algo `algo`
        attn.core_attention = ModuleSpec(module=qs.QuerySplitDotProductAttention, params={"flash_config": fc})
        attn.linear_proj = ModuleSpec(module=qs.QuerySplitRowParallelLinear, params={"flash_config": fc})
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def _batch(step, b=2, s=SEQ):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
            "attention_mask": torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)}


def _on_cp_rank(batch):
    """Megatron's own zigzag split (0.16: (batch, cp_group); 0.19: (batch, is_hybrid_cp, cp_group))."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    cp = parallel_state.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp)
    return get_batch_on_this_cp_rank(batch, cp_group=cp)


def _sync_grads(model, cp):
    from megatron.core import parallel_state

    for p in model.parameters():
        if p.grad is None:
            continue
        if cp > 1:
            dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())
        if getattr(p, "sequence_parallel", False) and parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())


def _train(model, cp, steps, mask, lr=0.5, grads=None):
    """-> the loss curve; `grads` (a dict, optional) gets {name: gradient} of step 0 after the grad sync."""
    from megatron.core import parallel_state

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        batch = _batch(step % 4)  # 4 batches in turn: the loss falls, the curve means something
        total = batch["labels"].numel()
        if not mask:
            batch["attention_mask"] = None
        if cp > 1:
            batch = _on_cp_rank(batch)
        opt.zero_grad()
        per_token = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        loss = per_token.float().sum() / total  # this rank's share of the global mean
        loss.backward()
        _sync_grads(model, cp)
        if step == 0 and grads is not None:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        value = loss.detach().clone()
        if cp > 1:
            dist.all_reduce(value, group=parallel_state.get_context_parallel_group())
        losses.append(value.item())
    return losses


def _grad_errors(got: dict, ref: dict) -> dict:
    """{name: max |got - ref| / max |ref|}: the step-0 gradients against the reference's, per tensor (the same
    names: both models loaded with strict=True)."""
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    return {n: (got[n] - ref[n]).abs().max().item() / ref[n].abs().max().item() for n in ref}


def cp_vs_no_cp(rank, world, tp=1, cp=2, steps=20, ulysses_algo="flash", mask=True, heads=4, groups=4,
                kind="ulysses"):
    """-> {"ref": losses without CP, "cp": losses with Ulysses CP, "grads": _grad_errors of step 0}."""
    from megatron.core import parallel_state

    ref_grads, cp_grads = {}, {}
    _init(tp, 1)
    try:
        ref = _model(tp, 1, "stock", heads, groups)
        init = {k: v.clone() for k, v in ref.state_dict().items() if isinstance(v, torch.Tensor)}
        ref_losses = _train(ref, 1, steps, mask, grads=ref_grads)
    finally:
        parallel_state.destroy_model_parallel()
    _init(tp, cp)
    try:
        model = _model(tp, cp, kind, heads, groups, ulysses_algo)
        model.load_state_dict(init, strict=True)  # every weight of the stock model, and no other
        cp_losses = _train(model, cp, steps, mask, grads=cp_grads)
        core = model.decoder.layers[0].self_attention.core_attention
        decided = {k.word: (c.pick, c.source) for k, c in getattr(core, "flash_chooser", None).decided.items()
                   if k.site == "ulysses"} if hasattr(core, "flash_chooser") else {}
    finally:
        parallel_state.destroy_model_parallel()
    return {"ref": ref_losses, "cp": cp_losses, "grads": _grad_errors(cp_grads, ref_grads), "decided": decided}


def _reseed(seed):
    """The default generator and Megatron's tracker, as at the start of a run (training draws its dropout here)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def query_split_vs_stock(rank, world, algo="flash", steps=20, mask=True, heads=4, groups=4, kind="qsa", dropout=0.0,
                         hidden_dropout=0.0):
    """TP=world with SP: the local spec vs the same spec with the query-split core attention + proj; both train
    from the same RNG states (with dropout: stock's masks are the draws of that state)."""
    from megatron.core import parallel_state

    _init(world, 1)
    try:
        ref = _model(world, 1, "stock", heads, groups, dropout=dropout, hidden_dropout=hidden_dropout)
        init = {k: v.clone() for k, v in ref.state_dict().items() if isinstance(v, torch.Tensor)}
        ref_grads, qs_grads = {}, {}
        _reseed(11)
        ref_losses = _train(ref, 1, steps, mask, grads=ref_grads)
        model = _model(world, 1, kind, heads, groups, algo, dropout=dropout, hidden_dropout=hidden_dropout)
        model.load_state_dict(init, strict=True)  # every weight of the stock model, and no other
        _reseed(11)
        seen = []
        for layer in model.decoder.layers:  # prove the fused path ran: the core attention deferred to proj
            layer.self_attention.core_attention.register_forward_hook(
                lambda m, i, o: seen.append(type(o).__name__))
        qs_losses = _train(model, 1, steps, mask, grads=qs_grads)
        proj = model.decoder.layers[0].self_attention.linear_proj
        decided = {k.word: (c.pick, c.source, k.shape) for k, c in proj.flash_chooser.decided.items()}
    finally:
        parallel_state.destroy_model_parallel()
    return {"ref": ref_losses, "cp": qs_losses, "outputs": sorted(set(seen)), "calls": len(seen),
            "grads": _grad_errors(qs_grads, ref_grads), "decided": decided}


def query_split_dropout(rank, world, steps=5, p=0.2):
    """Attention dropout through the Megatron layer: query split flash vs reference from the same RNG state
    (the layer draws one mask per call, stock's draw; each block applies its rows), and the curve without dropout."""
    from megatron.core import parallel_state

    curves = {}
    _init(world, 1)
    try:
        for name, algo, drop in (("flash", "flash", p), ("reference", "reference", p), ("off", "flash", 0.0)):
            model = _model(world, 1, "qsa", 4, 4, algo, dropout=drop)
            torch.manual_seed(3)
            curves[name] = _train(model, 1, steps, True)
    finally:
        parallel_state.destroy_model_parallel()
    return curves
