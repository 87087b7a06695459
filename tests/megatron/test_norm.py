"""Tier 3 (Megatron): SequenceParallelNorm (megatron/norm.py), the local spec's norm under SP without apex.

In-process checks build the norm alone (it needs a config, no process group). The GPT check runs on a
fresh gloo pool of its own (bodies in tests/megatron/mp_norm.py) where cpu.enable()'s norm shim is never
installed: on today's code (the local spec's WrappedTorchNorm) that build fails, as it does on a GPU.
Tolerances (fp32):
  norm vs a hand-written formula  1e-6 relative: the same math, torch's kernel orders the sums itself.
  norm vs torch's own module      exact: the same kernel on the same inputs.
  GPT ours vs stock               logits/loss 1e-6, grads 1e-5 relative: the norms are bitwise stock's;
                                  the core attention is SDPA vs baddbmm+softmax+bmm (fp32 sums reordered).
"""
import logging

import pytest
import torch

from megatron_flashoverlap.megatron import models as tm
from megatron_flashoverlap.megatron import norm
from tests.support import Pool


def _x(h=8):
    return torch.randn(4, 2, h, generator=torch.Generator().manual_seed(0), requires_grad=True)


def _ref_rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _ref_ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps) * w + b


@pytest.mark.parametrize("sp", [True, False])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_math_tags_and_keys(kind, sp):
    cfg = tm.tiny_config(2, sp, normalization=kind)
    m = norm.SequenceParallelNorm(config=cfg, hidden_size=8, eps=1e-5)
    stock_cls = torch.nn.RMSNorm if kind == "RMSNorm" else torch.nn.LayerNorm
    assert isinstance(m, stock_cls)
    assert list(m.state_dict()) == list(stock_cls(8).state_dict())  # weight (+ bias): the stock keys
    assert all(p.sequence_parallel is sp for p in m.parameters())  # finalize_model_grads reads this tag
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
    x = _x()
    ref = _ref_rms(x, m.weight, 1e-5) if kind == "RMSNorm" else _ref_ln(x, m.weight, m.bias, 1e-5)
    torch.testing.assert_close(m(x), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_is_bitwise_the_stock_torch_norm(kind):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = tm.tiny_config(1, False, normalization=kind)  # the stock norm builds only without SP
    ours, stock = norm.SequenceParallelNorm(cfg, 8, 1e-5), WrappedTorchNorm(cfg, 8, 1e-5)
    stock.load_state_dict(ours.state_dict())
    x1, x2 = _x(), _x()
    y1, y2 = ours(x1), stock(x2)
    y1.square().sum().backward()
    y2.square().sum().backward()
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad) and torch.equal(ours.weight.grad, stock.weight.grad)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_zero_centered_gamma(kind):
    cfg = tm.tiny_config(2, True, normalization=kind, layernorm_zero_centered_gamma=True)
    m = norm.SequenceParallelNorm(cfg, 8, 1e-5)
    assert torch.equal(m.weight, torch.zeros(8))  # starts at 0: gamma = weight + 1 = 1
    with torch.no_grad():
        m.weight.uniform_(-0.5, 0.5)
    x = _x()
    gamma = m.weight + 1
    ref = _ref_rms(x, gamma, 1e-5) if kind == "RMSNorm" else _ref_ln(x, gamma, m.bias, 1e-5)
    torch.testing.assert_close(m(x), ref, rtol=1e-6, atol=1e-6)


def test_unsupported_flags_say_the_fix(caplog):
    with pytest.raises(ValueError, match="memory-efficient-layer-norm"):
        norm.SequenceParallelNorm(tm.tiny_config(2, True, memory_efficient_layer_norm=True), 8)
    with pytest.raises(ValueError, match="--normalization L2Norm .*choose --normalization LayerNorm or RMSNorm"):
        norm.SequenceParallelNorm(tm.tiny_config(2, True, normalization="L2Norm"), 8)
    norm._LOGGED.discard("persist")
    with caplog.at_level(logging.WARNING, logger=norm.__name__):
        for _ in range(3):  # Megatron-LM's default is persist_layer_norm=True: accepted, said once
            assert isinstance(norm.SequenceParallelNorm(tm.tiny_config(2, True, persist_layer_norm=True), 8),
                              torch.nn.LayerNorm)
    assert sum("persist_layer_norm" in r.message for r in caplog.records) == 1


def test_layer_spec_puts_the_norm_in_every_slot():
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec, submodules_of

    cfg = tm.tiny_config(2, True, normalization="RMSNorm", qk_layernorm=True)
    block = flashoverlap_layer_spec(cfg)
    layer = block.layer_specs[0]
    attn = submodules_of(layer.submodules.self_attention)
    assert len(block.layer_specs) == cfg.num_layers and block.layer_norm is norm.SequenceParallelNorm
    assert {layer.submodules.input_layernorm, layer.submodules.pre_mlp_layernorm, attn.q_layernorm,
            attn.k_layernorm} == {norm.SequenceParallelNorm}
    assert block.submodules is layer.submodules  # read like the layer spec (Megatron's builder does)


@pytest.fixture(scope="module")
def fresh_pool():
    pool = Pool(2)  # not the session's: the norm shim must never have run in these processes
    yield pool
    pool.close()


def test_rmsnorm_sp_gpt_builds_without_the_norm_shim_and_matches_stock(fresh_pool):
    for res in fresh_pool.run("tests.megatron.mp_norm:rmsnorm_sp_gpt", timeout=300):
        assert "sequence parallel not supported" in (res["stock_error"] or ""), "the control must fail today"
        names = {n: kind for n, (kind, _) in res["norms"].items()}
        assert len(names) == 2 * 4 + 1 and set(names.values()) == {"TorchRMSNorm"}, names  # 4 per layer + final
        assert all(tags == [True] for _, tags in res["norms"].values())  # weight only, tagged
        assert res["init_equal"] and res["keys_equal"] and res["sharded_keys_equal"]
        assert res["logits_rel"] <= 1e-6
        stock, ours = res["loss"]
        assert abs(stock - ours) <= 1e-6 * abs(stock)
        worst = max(res["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, f"gradient of {worst[0]} differs by {worst[1]:.2e} (relative)"
        ck = res["checkpoint"]
        assert ck["differ_before"], "the fresh model must start different, or loading proves nothing"
        stock, ours, back = ck["losses"]
        assert abs(stock - ours) <= 1e-6 * abs(stock) and back == stock  # back: stock code, same weights
