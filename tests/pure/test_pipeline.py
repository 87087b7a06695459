"""Tier: pure (no processes: torch.distributed is not initialized, so every group is a group of one).
The pipeline API's own rules: a merged walk refuses two passes with one tag, the compute-only tail spreads
its pieces over the hop steps of a ring, and the shared numerics keep bf16/fp16 sums in fp32."""
import pytest
import torch

from megatron_flashoverlap.runtime import (OverlapContext, Producer, Ring, Sums, acc_dtype, gather, gather_and_consume,
                                          produce_and_scatter, scatter, tail, walk, wgrad)


def test_walk_refuses_two_passes_with_one_tag():
    ctx = OverlapContext()
    x = torch.zeros(2, 3)
    a = gather(x, lambda rows, xs: None, None, ctx, Ring(tag=0))
    b = gather(x, lambda rows, xs: None, None, ctx, Ring(tag=0))
    with pytest.raises(ValueError, match="own tag"):
        walk(None, ctx, a, b)


def test_group_of_one_consumes_the_local_shard_once():
    seen = []
    x = torch.arange(6.0).view(3, 2)
    kept = gather_and_consume(x, lambda rows, xs: seen.append((rows, xs.clone())), None, OverlapContext(),
                              keep_gathered=True)
    assert [r for r, _ in seen] == [(0, 3)] and torch.equal(seen[0][1], x) and torch.equal(kept, x)


def test_tail_runs_every_piece_once_in_order():
    ran = []
    walk(None, OverlapContext(), tail(5, ran.append, None, tag=2))
    assert ran == [0, 1, 2, 3, 4]
    assert tail(0, ran.append, None, tag=2) is None


def test_wgrad_is_dy_transposed_x_in_the_accumulation_dtype():
    g = torch.Generator().manual_seed(0)
    dy, x = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 5, generator=g)
    want = torch.einsum("sbn,sbh->nh", dy.double(), x.double())  # the formula, independent of the kernel
    assert torch.allclose(wgrad(dy, x).double(), want, atol=1e-5)  # fp32: 6-term sums reordered
    assert torch.allclose(wgrad(dy, x, slice(1, 3)).double(), want[1:3], atol=1e-5)
    assert wgrad(dy.bfloat16(), x.bfloat16()).dtype == torch.float32
    assert acc_dtype(torch.float16) == torch.float32 and acc_dtype(torch.float64) == torch.float64


def test_own_block_summed_in_place_and_deferred_finish():
    # group of one: the own block is the whole scatter; own_into receives it with no ring slot (the same
    # storage comes back), and with defer_last the walk hands back a finish that returns it
    own = torch.full((3, 2), -1.0)
    producer = Producer(lambda rows, out: out.copy_(torch.arange(6.0).view(3, 2)[rows[0]:rows[1]]), into=True,
                        own_into=own)
    f32 = Sums(torch.float32, torch.float32, torch.float32, "cpu")
    finish = produce_and_scatter(producer, (3, 2), f32, None, OverlapContext(), defer_last=True)
    got = finish()
    assert got.data_ptr() == own.data_ptr() and torch.equal(own, torch.arange(6.0).view(3, 2))


def test_own_into_must_hold_the_sum_dtype():
    with pytest.raises(ValueError, match="own_into is torch.bfloat16"):
        scatter(Producer(lambda rows: None, own_into=torch.zeros(3, 2, dtype=torch.bfloat16)), (3, 2),
                Sums(torch.float32, torch.bfloat16, torch.bfloat16, "cpu"), None, OverlapContext())
