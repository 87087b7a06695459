"""Attention dropout: query split's drawn masks are torch's dropout's draw (stock's masks, the RNG left where stock
leaves it); Ulysses' counter-based masks are split-invariant, one pass per block; TP ranks distinct where stock's are.

Tier: numerics (gloo processes; worker bodies in tests/megatron/mp_attention_dropout.py) plus in-process checks.
Masks are compared exactly: they are booleans, and the probes read them off outputs that are exact
(q = 0 gives probabilities 1/sk, v = I copies them, kept ones scale to a power of two).
Keep-rate bounds: 5 binomial standard deviations (a false failure has probability below 1e-6).
"""
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatron_flashoverlap.ops.attention import core
from megatron_flashoverlap.ops.attention.core import AttnSpec, attention_rows, keep_mask
from tests.megatron.mp_attention_dropout import _probe

BODY = "tests.megatron.mp_attention_dropout:"
# the in-place kernels behind every torch RNG call (torch.rand -> uniform_, dropout -> bernoulli_, ...)
RNG_KERNELS = {f"aten::{k}" for k in ("uniform_", "bernoulli_", "random_", "normal_", "exponential_", "geometric_",
                                      "cauchy_", "log_normal_", "multinomial", "randperm")}


def _within(count, n, p, sigmas=5.0):
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("cuts", [[(0, 16)], [(0, 8), (8, 16)], [(0, 4), (4, 8), (8, 12), (12, 16)],
                                  [(0, 5), (5, 6), (6, 16)]])  # P = 1, 2, 4 blocks, and uneven ones
def test_rows_split_into_blocks_get_the_masks_of_the_whole_sequence(cuts):
    spec = AttnSpec(scale=0.5, causal=False, dropout_p=0.4, seed=9)
    whole = keep_mask(spec, 2, 3, 0, 16, 16, "cpu")
    assert torch.equal(torch.cat([keep_mask(spec, 2, 3, a, b - a, 16, "cpu") for a, b in cuts], dim=2), whole)
    q, k, v, _ = _probe(16, 2, 3)  # the same through attention_rows: its outputs are exact here
    full = attention_rows(q, k, v, spec, 0)
    assert torch.equal(torch.cat([attention_rows(q[a:b], k, v, spec, a) for a, b in cuts]), full)
    assert torch.equal(full > 0, whole.permute(2, 0, 1, 3).reshape(16, 2, 48))  # ctx[i, b, h*sk + j] ~ keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_a_drawn_mask_is_torch_dropouts_draw_and_leaves_the_rng_where_dropout_does(dtype, p):
    # the reference is torch's own dropout from the same generator state: its output, and the draws after it
    shape = (2, 3, 40, 56)
    probs = torch.rand(shape, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    grad = torch.rand(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    torch.manual_seed(17)
    stock, stock_next = torch.nn.functional.dropout(probs, p, training=True), torch.rand(5)
    torch.manual_seed(17)
    keep = core.draw_keep(shape, dtype, p, "cpu")
    ours_next = torch.rand(5)
    assert keep.dtype == torch.bool and torch.equal(ours_next, stock_next)
    ours = core.apply_keep(probs, keep, p)
    assert torch.equal(ours, stock)
    assert torch.equal(torch.autograd.grad(ours, probs, grad)[0], torch.autograd.grad(stock, probs, grad)[0])
    probs = probs.detach()
    # a block of rows with its rows of the mask: stock's rows, so query split's blocks get stock's dropout
    spec = AttnSpec(scale=1.0, dropout_p=p, keep=keep)
    assert torch.equal(core._dropout(probs[:, :, 7:19], spec, 7), stock[:, :, 7:19])
    assert _within(int(keep.sum()), keep.numel(), 1 - p)


def test_a_drawn_mask_must_be_a_bool_mask_of_the_whole_sequence():
    with pytest.raises(ValueError, match="draw_keep"):
        core.Attend(dropout_p=0.1, keep=torch.ones(1, 1, 4, 4))  # not bool
    with pytest.raises(ValueError, match="draw_keep"):
        core.Attend(keep=torch.ones(1, 1, 4, 4, dtype=torch.bool))  # no rate


def test_seed_may_be_a_device_tensor():
    spec_int = AttnSpec(scale=1.0, dropout_p=0.3, seed=2 ** 40 + 5)
    spec_t = AttnSpec(scale=1.0, dropout_p=0.3, seed=torch.tensor(2 ** 40 + 5))
    assert torch.equal(keep_mask(spec_int, 2, 3, 4, 5, 6, "cpu"), keep_mask(spec_t, 2, 3, 4, 5, 6, "cpu"))


def _hash32(x):
    """Wellons' hash32 on a Python int (the formula keep_mask documents), written here apart from the code."""
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) % 2 ** 32
    x ^= x >> 12
    x = (x * 0x297A2D39) % 2 ** 32
    return x ^ (x >> 15)


@pytest.mark.parametrize("one_pass", [False, True], ids=["cpu_tiles", "one_pass_as_on_cuda"])
def test_keep_mask_is_the_documented_hash_at_every_tile_of_a_large_block(monkeypatch, one_pass):
    monkeypatch.setattr(core, "_one_pass", lambda device: one_pass)  # CUDA's indexing, run here on CPU
    seed, p = 2 ** 40 + 3, 0.25
    b, heads, a, n, sk = 2, 3, 5, 300, 2000  # 600K probabilities per head and batch: several CPU tiles of 2**18
    keep = keep_mask(AttnSpec(scale=1.0, dropout_p=p, seed=seed), b, heads, a, n, sk, "cpu")
    g = torch.Generator().manual_seed(0)
    picks = [(0, 0, 0, 0), (b - 1, heads - 1, n - 1, sk - 1), (1, 2, 131, 0), (0, 1, 130, sk - 1)]
    picks += [tuple(int(torch.randint(m, (1,), generator=g)) for m in (b, heads, n, sk)) for _ in range(3000)]
    s = _hash32((seed ^ (seed >> 32)) % 2 ** 32)
    for bi, hd, i, j in picks:
        h = _hash32(_hash32(_hash32(s ^ (bi * heads + hd)) ^ (a + i)) ^ j)
        assert bool(keep[bi, hd, i, j]) == (h < int((1 - p) * 2 ** 32)), (bi, hd, i, j)


def _profiled_ops(rows):
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(rows, 2, 4, 8, generator=g), torch.randn(32, 2, 4, 8), torch.randn(32, 2, 4, 8)
    spec = AttnSpec(scale=0.3, causal=False, dropout_p=0.2, seed=3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attention_rows(q, k, v, spec, 7)
    names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    rng = [n for n in names if n in RNG_KERNELS]
    return len(names), rng


def test_at_most_one_rng_launch_per_block_whatever_its_rows():
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the counter sees one torch.rand as one launch
        torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    assert [e.name for e in prof.events() if e.name in RNG_KERNELS] == ["aten::uniform_"]
    ops_2, rng_2 = _profiled_ops(2)
    ops_16, rng_16 = _profiled_ops(16)
    assert len(rng_2) <= 1 and len(rng_16) <= 1, (rng_2, rng_16)  # counter-based: no generator launch at all
    assert ops_2 == ops_16  # the block is one vectorized pass: nothing is launched per query row


def test_keep_rate_and_independence_within_binomial_bounds():
    p = 0.3
    spec = AttnSpec(scale=1.0, dropout_p=p, seed=123)
    keep = keep_mask(spec, 2, 4, 0, 96, 96, "cpu")  # [b, np, s, sk]
    n = keep.numel()
    assert _within(keep.sum().item(), n, 1 - p)
    other = keep_mask(AttnSpec(scale=1.0, dropout_p=p, seed=124), 2, 4, 0, 96, 96, "cpu")
    agree = (1 - p) ** 2 + p ** 2  # two independent masks agree this often
    assert _within((keep == other).sum().item(), n, agree)  # another seed: another mask
    for a, b in ((keep[..., 1:], keep[..., :-1]), (keep[:, :, 1:], keep[:, :, :-1]), (keep[:, 1:], keep[:, :-1]),
                 (keep[1:], keep[:-1])):  # neighbouring keys, rows, heads, batches
        assert _within((a == b).sum().item(), a.numel(), agree)
    for p2 in (0.1, 0.5, 0.9):
        k2 = keep_mask(AttnSpec(scale=1.0, dropout_p=p2, seed=5), 1, 2, 0, 64, 64, "cpu")
        assert _within(k2.sum().item(), k2.numel(), 1 - p2)


@pytest.mark.parametrize("world", [2, 4])
def test_query_split_masks_equal_the_reference(pools, world):
    for r in pools(world).run(BODY + "query_split_masks", timeout=300):
        assert r["flash_equal"] and r["ref_equal"] and r["two_levels"], r
        assert _within(r["kept"] * 8 * 2 * 4 * 8, 8 * 2 * 4 * 8, 0.5), r  # s * b * heads * sk probabilities


# (sequence_parallel, inside the model-parallel fork, stock's masks differ across TP ranks)
@pytest.mark.parametrize("sp,fork,distinct", [(False, False, True), (True, True, True), (True, False, False)])
def test_tp_ranks_get_distinct_masks_where_stock_does(pools, sp, fork, distinct):
    # no SP: both draw inside get_cuda_rng_tracker().fork(); SP inside TransformerBlock's fork; SP standalone:
    # both draw from the default RNG, the same on every TP rank
    for r in pools(2).run(BODY + "tp_rank_masks", sp, fork, timeout=300):
        assert r["stock"] is distinct, r  # the probe sees stock's rule as described
        assert r["ours"] is r["stock"], r
        assert r["equal"] and r["next_equal"], r  # stock's masks, and the RNG left where stock leaves it
        assert _within(r["ours_kept"] * 512, 512, 0.5), r  # 8 rows x 2 batches x 2 heads x 8 keys
