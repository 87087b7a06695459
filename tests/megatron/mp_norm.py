"""Worker bodies for test_norm.py: an RMSNorm + SP GPT from flashoverlap_layer_spec, built in a process
where cpu.enable()'s norm shim was NEVER installed (only the device, RNG and causal-mask shims), then the
stock local spec (which needs that shim) beside it for the numerics and the checkpoint round trip.

Run them only on a fresh pool of their own (test_norm.py makes one): the norm shim, once installed in the
second phase, cannot be taken out of the process again.
"""
from __future__ import annotations

import io

import torch

from megatron_flashoverlap.megatron import cpu
from megatron_flashoverlap.megatron import models as tm


def _init_without_norm_shim(tp: int) -> None:
    """cpu.enable() minus _shim_torch_norm: what a GPU run sees of Megatron's norms."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import torch_norm

    assert not cpu.is_enabled(), "this body needs a fresh pool: cpu.enable() ran here already"
    assert not getattr(torch_norm.WrappedTorchNorm.__new__, "_flashoverlap_cpu", False)
    cpu.enable(relax_norm=False)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)


def _rel(a, b) -> float:
    scale = a.detach().double().abs().max().item()
    return (a.detach().double() - b.detach().double()).abs().max().item() / scale


def _stock_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)


def _norm_report(model) -> dict:
    """Every norm module: its class name and whether each of its params is tagged sequence_parallel."""
    out = {}
    for name, mod in model.named_modules():
        if name.endswith("layernorm") and type(mod).__name__ != "IdentityOp":  # pre_cross_attn: unused slot
            out[name] = (type(mod).__name__, [bool(getattr(p, "sequence_parallel", False)) for p in mod.parameters()])
    return out


def _fwd_bwd(model, data):
    logits = tm.gpt_logits(model, data)
    loss = tm.gpt_loss(model, data)
    loss.backward()
    tm.allreduce_sequence_parallel_grads(model)  # finalize_model_grads' SP all-reduce
    return logits.detach(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _reload(dst, src):
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst.load_state_dict(torch.load(buf, weights_only=False), strict=True)


def _sharded_keys(model):
    from megatron.core import parallel_state

    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    return sorted((k, tuple(getattr(v, "global_shape", ())), tuple(getattr(v, "global_offset", ())))
                  for k, v in model.sharded_state_dict(metadata=meta).items())


def _phase_without_shim(cfg, data) -> tuple:
    """-> (report, our model, our numbers): the stock spec must fail here, ours must build."""
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    report = {}
    try:
        tm.build_gpt(cfg, _stock_spec())
        report["stock_error"] = None
    except AssertionError as err:  # WrappedTorchNorm: "sequence parallel not supported by torch LayerNorm"
        report["stock_error"] = str(err)
    ours = tm.build_gpt(cfg, flashoverlap_layer_spec(cfg))
    report["norms"] = _norm_report(ours)
    return report, ours, _fwd_bwd(ours, data)


def rmsnorm_sp_gpt(rank, world):
    """RMSNorm + qk_layernorm + SP GPT at TP=world: ours without the shim vs stock with it."""
    _init_without_norm_shim(world)
    try:
        cfg = tm.tiny_config(world, True, normalization="RMSNorm", qk_layernorm=True)
        data = tm.batch(3)
        report, ours, (logits_o, loss_o, grads_o) = _phase_without_shim(cfg, data)
        cpu._shim_torch_norm()  # phase 2: the stock local spec can only build with the shim
        stock = tm.build_gpt(cfg, _stock_spec())
        report["init_equal"] = all(torch.equal(p, q) for p, q in zip(stock.parameters(), ours.parameters()))
        report["keys_equal"] = list(stock.state_dict()) == list(ours.state_dict())
        report["sharded_keys_equal"] = _sharded_keys(stock) == _sharded_keys(ours)
        logits_s, loss_s, grads_s = _fwd_bwd(stock, data)
        report["logits_rel"], report["loss"] = _rel(logits_s, logits_o), (loss_s, loss_o)
        report["grad_rel"] = {n: _rel(g, grads_o[n]) for n, g in grads_s.items()}
        report["checkpoint"] = _roundtrip(cfg, stock, ours, data)
        return report
    finally:
        tm.destroy()


def _roundtrip(cfg, stock, ours, data) -> dict:
    """stock weights -> a fresh differently-seeded model of ours -> a fresh stock model: losses."""
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    fresh_ours = tm.build_gpt(cfg, flashoverlap_layer_spec(cfg), seed=11)
    fresh_stock = tm.build_gpt(cfg, _stock_spec(), seed=12)
    with torch.no_grad():
        differ = not all(torch.equal(p, q) for p, q in zip(stock.parameters(), fresh_ours.parameters()))
        _reload(fresh_ours, stock)
        loss_ours = tm.gpt_loss(fresh_ours, data).item()
        _reload(fresh_stock, fresh_ours)
        losses = (tm.gpt_loss(stock, data).item(), loss_ours, tm.gpt_loss(fresh_stock, data).item())
    return {"differ_before": differ, "losses": losses}
