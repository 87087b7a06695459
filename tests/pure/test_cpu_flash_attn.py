"""Tier 1 (no processes): megatron/cpu_flash_attn.py, the torch stand-in for flash-attn 2's inference kernels
that Megatron's dynamic engine calls on CPU, against a per-query loop written from the definition
(softmax(q . k_j * scale over the keys query i may see) @ v). fp32 throughout: the loop and the kernel sum in
another order, so close (1e-5 relative), not equal."""
import pytest
import torch

from megatron_flashoverlap.megatron import cpu_flash_attn as fa

H, HK, D, BLOCK = 4, 2, 8, 4
TOL = dict(rtol=1e-5, atol=1e-6)


def _by_definition(q, k, v, scale, left=-1):
    """q [Sq, H, D], k / v [Sk, Hk, D]: one query at a time, bottom-right causal, optional left window."""
    sq, sk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(sq):
        last = sk - sq + i
        first = 0 if left < 0 else max(0, last - left)
        for h in range(q.shape[1]):
            keys, values = k[first:last + 1, h // group], v[first:last + 1, h // group]
            out[i, h] = torch.softmax(keys @ q[i, h] * scale, dim=0) @ values
    return out


def _paged(seqs, num_blocks=16, seed=0):
    """Requests' K (or V) [n_r, Hk, D] -> (cache [num_blocks, BLOCK, Hk, D], block_table [B, max_blocks]),
    blocks scattered in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    cache = torch.randn(num_blocks, BLOCK, HK, D, generator=g)  # garbage where nothing is written
    width = max((len(s) + BLOCK - 1) // BLOCK for s in seqs)
    table = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for b, s in enumerate(seqs):
        for j in range((len(s) + BLOCK - 1) // BLOCK):
            block = free.pop()
            table[b, j] = block
            rows = s[j * BLOCK:(j + 1) * BLOCK]
            cache[block, :len(rows)] = rows
    return cache, table


def _requests(q_lens, k_lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(n, H, D, generator=g) for n in q_lens]
    ks = [torch.randn(n, HK, D, generator=g) for n in k_lens]
    vs = [torch.randn(n, HK, D, generator=g) for n in k_lens]
    return qs, ks, vs


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("left", [-1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_varlen_prefill_and_mixed_steps(paged, left):
    q_lens, k_lens = [5, 1, 7], [5, 9, 11]  # a fresh prompt, a decode, a chunk after a cached prefix
    qs, ks, vs = _requests(q_lens, k_lens)
    scale = D ** -0.5
    if paged:
        (k, table), (v, v_table) = _paged(ks), _paged(vs)
        assert torch.equal(v_table, table)  # same seed: the same block layout for K and V
    else:
        k, v, table = torch.cat(ks), torch.cat(vs), None
    out = fa.flash_attn_varlen_func(torch.cat(qs), k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens),
                                    softmax_scale=scale, causal=True, window_size=(left, -1), block_table=table)
    want = torch.cat([_by_definition(q, k, v, scale, left) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out, want, **TOL)


def test_kvcache_decode_is_the_last_row_of_the_prefill():
    k_lens = [6, 13, 1]
    qs, ks, vs = _requests([1, 1, 1], k_lens, seed=2)
    (k_cache, table), (v_cache, _) = _paged(ks, seed=5), _paged(vs, seed=5)
    out, lse = fa.flash_attn_with_kvcache(torch.stack(qs), k_cache, v_cache, cache_seqlens=torch.tensor(k_lens), causal=True,
                                         block_table=table, return_softmax_lse=True)
    assert out.shape == (3, 1, H, D) and lse.shape == (3, H, 1)
    for b in range(3):
        torch.testing.assert_close(out[b], _by_definition(qs[b], ks[b], vs[b], D ** -0.5), **TOL)


def test_a_request_does_not_depend_on_the_batch():
    qs, ks, vs = _requests([3, 8], [3, 8], seed=3)
    together = fa.flash_attn_varlen_func(torch.cat(qs), torch.cat(ks), torch.cat(vs), _cu([3, 8]), _cu([3, 8]),
                                         causal=True)
    alone = fa.flash_attn_varlen_func(qs[1], ks[1], vs[1], _cu([8]), _cu([8]), causal=True)
    assert torch.equal(together[3:], alone)  # bitwise: each request is computed on its own


def test_bf16_in_bf16_out_and_bad_input_is_named():
    qs, ks, vs = _requests([4], [4], seed=4)
    out = fa.flash_attn_varlen_func(qs[0].bfloat16(), ks[0].bfloat16(), vs[0].bfloat16(), _cu([4]), _cu([4]),
                                    causal=True)
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not a multiple"):
        fa.flash_attn_varlen_func(torch.randn(4, 3, D), ks[0], vs[0], _cu([4]), _cu([4]), causal=True)
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        fa.flash_attn_varlen_func(qs[0], ks[0], vs[0], _cu([4]), _cu([4]), dropout_p=0.1)
