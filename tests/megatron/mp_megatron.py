"""Worker-side bodies of the Megatron GPT tests (run on every rank by the gloo pool).

Each body sets up TP over the pool's ranks, builds a tiny real GPTModel twice (stock local spec and
flashoverlap_layer_spec) and returns numbers; the tests assert on them. Every body destroys the
model-parallel state in a `finally` (the pools are shared between test files).
"""
from __future__ import annotations

import io

import torch

from megatron_flashoverlap.megatron import models as tm
from tests.support import profile


def _specs(cfg, flash_config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flashoverlap.megatron.spec import layer_spec

    return get_gpt_layer_local_spec(), layer_spec(flash_config)


def _flash(choice):
    """A configs/<name>.yaml by name, or a dict for config.from_dict."""
    from megatron_flashoverlap.config import from_dict, load_config

    return from_dict(choice) if isinstance(choice, dict) else load_config(f"configs/{choice}.yaml")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |a| (0 when both are zero)."""
    scale = a.detach().double().abs().max().item()
    diff = (a.detach().double() - b.detach().double()).abs().max().item()
    return diff / scale if scale else diff


def _models(tp, sp, config_name, seed=7):
    cfg = tm.tiny_config(tp, sp)
    stock_spec, our_spec = _specs(cfg, _flash(config_name))
    stock, ours = tm.build_gpt(cfg, stock_spec, seed), tm.build_gpt(cfg, our_spec, seed)
    return stock, ours


def _same_params(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def gpt_vs_stock(rank, world, tp, sp, config_name="flash", steps=20, lr=1e-2):
    """Same weights -> logits, loss, every grad, then `steps` Adam steps; -> numbers for the test."""
    tm.init_tp(tp)
    try:
        stock, ours = _models(tp, sp, config_name)
        out = {"init_equal": _same_params(stock, ours)}
        data = tm.batch(0)
        out["logits_rel"] = _rel(tm.gpt_logits(stock, data), tm.gpt_logits(ours, data))
        loss_s = tm.gpt_loss(stock, data)
        loss_s.backward()
        holder = {}
        out["fns"] = profile.autograd_fns(lambda: holder.setdefault("l", tm.gpt_loss(ours, data)).backward())
        out["loss"] = (loss_s.item(), holder["l"].item())
        out["sp_tagged"] = tm.allreduce_sequence_parallel_grads(stock)
        tm.allreduce_sequence_parallel_grads(ours)
        out["grad_rel"] = {n: _rel(p.grad, q.grad) for (n, p), q in zip(stock.named_parameters(), ours.parameters())}
        out["curves"] = [_train(m, steps, lr) for m in (stock, ours)]
        return out
    finally:
        tm.destroy()


def _train(model, steps, lr):
    """Adam on one fixed batch (the loss must fall), SP grads all-reduced like finalize_model_grads."""
    return tm.adam_steps(model, tm.batch(100), steps, lr)


def layer_comm_profile(rank, world, tp):
    """One TransformerLayer (SP on), fwd+bwd after a warm-up step: c10d ops per spec."""
    tm.init_tp(tp)
    try:
        stock, ours = _models(tp, True, "flash")
        counts = {}
        for name, model in (("stock", stock), ("ours", ours)):
            layer = model.decoder.layers[0]
            x = torch.randn(tm.SEQ // tp, 2, layer.config.hidden_size, requires_grad=True)

            def step():
                layer(x, attention_mask=None)[0].sum().backward()

            step()  # warm-up: our layers check their peers' shapes once (one small all-gather)
            counts[name] = profile.comm_ops(step)
        return counts
    finally:
        tm.destroy()


def _keys_shapes(model):
    return [(k, tuple(v.shape) if isinstance(v, torch.Tensor) else None) for k, v in model.state_dict().items()]


def _reload(dst, src):
    """src -> bytes (torch.save, as a checkpoint file) -> dst.load_state_dict(strict=True)."""
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst.load_state_dict(torch.load(buf, weights_only=False), strict=True)


def checkpoint_roundtrip(rank, world, tp, sp):
    """stock ckpt -> ours -> stock; models start from DIFFERENT seeds so a silent non-load shows."""
    tm.init_tp(tp)
    try:
        cfg = tm.tiny_config(tp, sp)
        stock_spec, our_spec = _specs(cfg, _flash("flash"))
        stock, ours, back = (tm.build_gpt(cfg, s, seed) for s, seed in ((stock_spec, 1), (our_spec, 2),
                                                                        (stock_spec, 3)))
        data = tm.batch(5)
        out = {"keys_equal": _keys_shapes(stock) == _keys_shapes(ours), "differ_before": not _same_params(stock, ours)}
        with torch.no_grad():
            loss_stock = tm.gpt_loss(stock, data).item()
            _reload(ours, stock)
            loss_ours = tm.gpt_loss(ours, data).item()
            _reload(back, ours)
            loss_back = tm.gpt_loss(back, data).item()
        out["losses"] = (loss_stock, loss_ours, loss_back)
        out["sharded_keys_equal"] = _sharded_keys(stock) == _sharded_keys(ours)
        return out
    finally:
        tm.destroy()


def _sharded_keys(model):
    """(key, global shape, shard offsets) of the dist-checkpointing view, as the checkpoint stores it."""
    from megatron.core import parallel_state

    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    sd = model.sharded_state_dict(metadata=meta)
    return sorted((k, tuple(getattr(v, "global_shape", ())), tuple(getattr(v, "global_offset", ())))
                  for k, v in sd.items())


def hybrid_layers(rank, world, tp):
    """HybridStack's '*' and '-' layers from hybrid_stack_spec, ours vs stock=True, chained fwd+bwd (SP on).
    HybridStack itself needs Transformer Engine (its final norm is TENorm), so the layers are built alone."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from megatron_flashoverlap.config import uniform
    from megatron_flashoverlap.megatron.spec import hybrid_stack_spec

    tm.init_tp(tp)
    try:
        cfg = tm.tiny_config(tp, True)
        runs = []
        for stock in (True, False):
            sub = hybrid_stack_spec(uniform("flash"), stock=stock).submodules  # flash: auto's probe calls ours too
            torch.manual_seed(7)
            model_parallel_cuda_manual_seed(7)
            layers = [build_module(sub.attention_layer, config=cfg, layer_number=1),
                      build_module(sub.mlp_layer, config=cfg, layer_number=2)]
            x = torch.randn(tm.SEQ // tp, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(1),
                            requires_grad=True)

            def step():
                h = layers[1](layers[0](x, attention_mask=None)[0], attention_mask=None)[0]
                h.square().sum().backward()
                runs.append(h.detach())

            fns = profile.autograd_fns(step)
            runs.append((fns, x.grad, [type(m).__name__ for layer in layers for m in layer.modules()]))
        (y_s, (fns_s, dx_s, _)), (y_o, (fns_o, dx_o, names)) = runs[0:2], runs[2:4]
        return {"y_rel": _rel(y_s, y_o), "dx_rel": _rel(dx_s, dx_o), "fns": (fns_s, fns_o),
                "flash_modules": sorted({n for n in names if n.startswith("Flash")})}
    finally:
        tm.destroy()
