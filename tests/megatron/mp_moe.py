"""Worker-side bodies of the MoE GPT tests (run on every rank by the gloo pool).

Each body sets up TP x EP (expert-TP etp) over the pool's ranks, builds a tiny MoE GPTModel twice, from
stock's local MoE spec and from get_gpt_layer_flashoverlap_spec, with the same seed, and returns numbers.
Tokens differ per data-parallel rank (seed = DP rank), so the split sizes are uneven and differ per rank.
"""
from __future__ import annotations

import warnings

import torch

from megatron_flashoverlap.megatron import models as tm
from tests.support import profile

from .mp_megatron import _rel

EXPERTS, TOPK = 4, 2
VARIANTS = {
    "dropless": {},
    "capacity": {"moe_expert_capacity_factor": 1.0, "moe_token_drop_policy": "probs"},
    "padded": {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
    "shared": {"moe_shared_expert_intermediate_size": 48},
    "top1": {"moe_router_topk": 1, "moe_router_pre_softmax": True},  # Megatron requires pre-softmax at top-1
}


def _init(tp: int, ep: int, etp: int, seed: int = 1234) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_flashoverlap.megatron import cpu

    cpu.enable()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(seed)


def _config(tp, ep, etp, variant, **structure):
    kw = {"num_moe_experts": EXPERTS, "moe_router_topk": TOPK, "moe_token_dispatcher_type": "alltoall",
          "moe_aux_loss_coeff": 1e-2, "moe_router_load_balancing_type": "aux_loss", "moe_ffn_hidden_size": 32,
          "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp, "add_bias_linear": False}
    return tm.tiny_config(tp, tp > 1, **{**kw, **VARIANTS[variant], **structure})


def _specs(cfg, algo, choices=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flashoverlap.config import from_dict
    from megatron_flashoverlap.megatron.spec import get_gpt_layer_flashoverlap_spec

    flash = from_dict({"moe": {"algo": algo}, **({"choices": choices} if choices is not None else {})})
    return (get_gpt_layer_local_spec(num_experts=EXPERTS),
            get_gpt_layer_flashoverlap_spec(num_experts=EXPERTS, flash_config=flash))


def _aux_loss() -> float:
    """The load-balancing loss of every layer this forward saved in Megatron's tracker (then cleared)."""
    from megatron.core.transformer.moe import moe_utils

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy tracker API: present (deprecated) in 0.16 - 0.19
        values = {k: v["values"].detach().clone() for k, v in moe_utils.get_moe_layer_wise_logging_tracker().items()}
        moe_utils.clear_aux_losses_tracker()
    return float(sum(v.sum() for v in values.values())) if values else float("nan")


def _routes(model):
    return [layer.mlp.token_dispatcher.routing_map.clone() for layer in model.decoder.layers]


def moe_gpt_vs_stock(rank, world, tp, ep, etp, variant="dropless", algo="flash", steps=3, choices=None):
    """Same weights -> logits, loss, aux loss, routing, every grad, then `steps` Adam steps; with algo auto, the
    chooser's decisions {word: (pick, source)} and what each MoE layer ran after its first training forward."""
    from megatron.core import parallel_state

    _init(tp, ep, etp)
    try:
        cfg = _config(tp, ep, etp, variant)
        stock_spec, our_spec = _specs(cfg, algo, choices)
        _why_not(forget=True)  # the pool's process outlives a test: start with nothing logged
        stock, ours = tm.build_gpt(cfg, stock_spec), tm.build_gpt(cfg, our_spec)
        out = {"keys_equal": _keys(stock) == _keys(ours),
               "init_equal": all(torch.equal(p, q) for p, q in zip(stock.parameters(), ours.parameters())),
               "dispatcher": type(ours.decoder.layers[0].mlp.token_dispatcher).__name__,
               "fused": [layer.mlp.flash_fused for layer in ours.decoder.layers], "why_not_fused": _why_not()}
        data = tm.batch(parallel_state.get_data_parallel_rank())
        _aux_loss()
        losses, aux, routes = [], [], []
        for model in (stock, ours):
            loss = tm.gpt_loss(model, data)
            aux.append(_aux_loss())
            routes.append(_routes(model))
            loss.backward()
            losses.append(loss.item())
            tm.allreduce_sequence_parallel_grads(model)
        out.update(loss=losses, aux=aux, routes_equal=all(torch.equal(a, b) for a, b in zip(*routes)))
        out["logits_rel"] = _rel(tm.gpt_logits(stock, data), tm.gpt_logits(ours, data))
        out["grad_rel"] = {n: _rel(p.grad, q.grad) for (n, p), q in zip(stock.named_parameters(), ours.parameters())}
        out["curves"] = [_train(m, steps, data) for m in (stock, ours)]
        mlp = ours.decoder.layers[0].mlp
        out["decided"] = {k.word: (c.pick, c.source) for k, c in mlp.flash_chooser.decided.items()}
        out["fused_after"] = [layer.mlp.flash_fused for layer in ours.decoder.layers]
        return out
    finally:
        tm.destroy()


def moe_freq_vs_stock(rank, world, freq, num_layers, steps=3):
    """--moe-layer-freq `freq` at EP = world: stock's per-layer block spec (get_gpt_decoder_block_spec) vs
    flashoverlap_layer_spec(config) and the ModuleSpec flashoverlap_layer (what --flash-overlap selects), same
    seed -> layer kinds, parameter counts and keys, init, loss, every grad, `steps` Adam steps."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_flashoverlap.megatron.spec import flashoverlap_layer, flashoverlap_layer_spec

    _init(1, world, 1)
    try:
        cfg = _config(1, world, 1, "dropless", moe_layer_freq=freq, num_layers=num_layers)
        specs = {"stock": get_gpt_decoder_block_spec(cfg, use_transformer_engine=False),
                 "block": flashoverlap_layer_spec(cfg), "module": flashoverlap_layer}
        models = {name: tm.build_gpt(cfg, spec) for name, spec in specs.items()}
        stock = models["stock"]
        out = {"kinds": {n: [type(layer.mlp).__name__ for layer in m.decoder.layers] for n, m in models.items()},
               "count": {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()},
               "keys_equal": all(_keys(m) == _keys(stock) for m in models.values()),
               "init_equal": all(torch.equal(p, q) for m in models.values()
                                 for p, q in zip(stock.parameters(), m.parameters()))}
        if not out["keys_equal"]:
            return out  # another model: the test names the layer kinds
        data = tm.batch(parallel_state.get_data_parallel_rank())
        _aux_loss()
        out["loss"] = {}
        for name, model in models.items():
            loss = tm.gpt_loss(model, data)
            loss.backward()
            out["loss"][name] = loss.item()
            _aux_loss()
        out["grad_rel"] = max(_rel(p.grad, q.grad) for name in ("block", "module")
                              for p, q in zip(stock.parameters(), models[name].parameters()))
        out["curves"] = {name: _train(model, steps, data) for name, model in models.items()}
        return out
    finally:
        tm.destroy()


def _why_not(forget=False):
    """The reasons flash could not fuse that this process logged (one line each); forget: clear them."""
    from megatron_flashoverlap.megatron.moe import layer as moe

    if forget:
        moe._LOGGED.clear()
    return sorted(r for r in moe._LOGGED if r != "allgather")


def _keys(model):
    return [(k, tuple(v.shape) if isinstance(v, torch.Tensor) else None) for k, v in model.state_dict().items()]


def _train(model, steps, data, lr=1e-2):
    losses = tm.adam_steps(model, data, steps, lr)
    _aux_loss()
    return losses


def moe_layer_comm(rank, world, tp, ep, etp, algo="flash"):
    """One MoE layer (model.decoder.layers[0].mlp) fwd+bwd after a warm-up: c10d ops, stock and ours, and
    the trace of our walks: [(what, compute label or None), ...] in the order they ran."""
    from megatron.core import parallel_state

    from megatron_flashoverlap.runtime import OverlapContext

    _init(tp, ep, etp)
    try:
        cfg = _config(tp, ep, etp, "dropless")
        counts = {}
        for name, spec in zip(("stock", "ours"), _specs(cfg, algo)):
            mlp = tm.build_gpt(cfg, spec).decoder.layers[0].mlp
            x = torch.randn(tm.SEQ // tp, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(rank))

            def step():
                mlp(x.requires_grad_())[0].sum().backward()

            step()
            counts[name] = profile.comm_ops(step)
            if name == "ours":
                mlp.token_dispatcher.flash_ctx = OverlapContext(check_peers=False, trace=[])
                step()
                counts["trace"] = [(e.what, e.label if e.what == "compute" else None)
                                   for e in mlp.token_dispatcher.flash_ctx.trace]
                counts["ep_rank"] = parallel_state.get_expert_model_parallel_rank()
            _aux_loss()
        return counts
    finally:
        tm.destroy()


def block_spec_builds(rank, world, tp, ep, etp):
    """flashoverlap_layer_spec(config) (the --spec entry) builds the MoE GPT with stock's state_dict keys."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    _init(tp, ep, etp)
    try:
        cfg = _config(tp, ep, etp, "shared")
        stock = tm.build_gpt(cfg, get_gpt_layer_local_spec(num_experts=EXPERTS))
        ours = tm.build_gpt(cfg, flashoverlap_layer_spec(cfg))
        return {"keys_equal": _keys(stock) == _keys(ours), "mlp": type(ours.decoder.layers[0].mlp).__name__,
                "shared_fc1": type(ours.decoder.layers[0].mlp.shared_experts.linear_fc1).__name__}
    finally:
        tm.destroy()


def refused(rank, world, field, value):
    """-> the ValueError message when the MoE config sets `field` = value (building our spec's model)."""
    _init(1, world, 1)
    try:
        cfg = _config(1, world, 1, "dropless")
        setattr(cfg, field, value)
        try:
            tm.build_gpt(cfg, _specs(cfg, "flash")[1])
        except ValueError as err:
            return str(err)
        return None
    finally:
        tm.destroy()
