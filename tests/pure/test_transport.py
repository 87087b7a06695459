"""Tier: pure (no processes). The transport a backend gets (a pure function of the backend and device
names), the context's size-class buffers and their stated cap, the check_peers words, the in-place GEMM
slice writer and the schedule caches of the pipeline."""
import pytest
import torch
import torch.nn.functional as F

from megatron_flashoverlap.runtime import OverlapContext, rows_writer, transport_kind
from megatron_flashoverlap.runtime.context import size_class
from megatron_flashoverlap.runtime.executor import prepare
from megatron_flashoverlap.runtime.pipeline import merged, schedule
from megatron_flashoverlap.schedules import all_gather_ring, reduce_scatter_ring


@pytest.mark.parametrize("backend, device, kind", [
    ("nccl", "cuda", "stream"),               # stream-ordered, untimed: no host sync per ring step
    ("gloo", "cpu", "timed"),                 # host-driven: only a timed wait notices a dead peer
    ("gloo", "cuda", "timed"),                # gloo moves CUDA tensors through the host too
    ("mpi", "cpu", "timed"),
    ("fake", "cpu", "stream"),                # torch's fake group stands in for NCCL when timing the host
    ("cpu:gloo,cuda:nccl", "cpu", "timed"),   # a mixed backend: the device's own entry decides
    ("cpu:gloo,cuda:nccl", "cuda", "stream"),
    ("xccl", "cuda", "stream"),               # any other backend of CUDA tensors orders streams
    ("ucc", "cpu", "timed"),                  # unknown host backends keep the bounded wait
])
def test_transport_kind_is_a_function_of_backend_and_device(backend, device, kind):
    assert transport_kind(backend, device) == kind


def test_size_class_rounds_up_in_eighths():
    for n in list(range(1, 300)) + [1000, 4097, 10 ** 6 + 3]:
        c = size_class(n)
        assert n <= c <= max(16, n + n / 8), (n, c)  # at most 1/8 more than asked (16 elements at least)


def test_buffers_of_many_lengths_hold_at_most_nine_eighths_of_the_largest():
    ctx, largest = OverlapContext(), 0
    for s in range(3, 103):  # 100 distinct sequence lengths, in an order that grows and shrinks
        s = 3 + (s * 37) % 100
        for name in ("ag.0.0", "ag.0.1", "rs.recv.0"):
            ctx.buffer(name, (s, 2, 5), torch.float32, torch.device("cpu"))
        largest = max(largest, s)
    per_name = largest * 2 * 5 * 4  # bytes of the largest request of each name
    assert ctx.held_bytes() <= 3 * (per_name * 9 / 8)  # the cap stated in runtime/context.py


def test_buffer_reuse_keeps_data_and_names_never_alias():
    ctx, cpu = OverlapContext(), torch.device("cpu")
    a = ctx.buffer("ag.0.0", (4, 3), torch.float32, cpu)
    b = ctx.buffer("ag.0.1", (4, 3), torch.float32, cpu)  # the other ring slot: distinct memory
    a.fill_(1.0)
    b.fill_(2.0)
    assert torch.equal(ctx.buffer("ag.0.0", (4, 3), torch.float32, cpu), torch.ones(4, 3))  # same request: same data
    small = ctx.buffer("ag.0.0", (2, 3), torch.float32, cpu)  # smaller: a view of the same storage
    assert small.data_ptr() == a.data_ptr() and torch.equal(b, torch.full((4, 3), 2.0))
    big = ctx.buffer("ag.0.0", (40, 3), torch.float32, cpu)  # larger: a new storage of the next size class
    assert big.shape == (40, 3) and big.untyped_storage().nbytes() == size_class(120) * 4
    assert ctx.buffer("ag.0.0", (4, 3), torch.bfloat16, cpu).dtype == torch.bfloat16  # dtype is part of the key


@pytest.mark.parametrize("word, want", [("once", "once"), ("always", "always"), ("never", "never"),
                                        (True, "always"), (False, "never")])
def test_check_peers_words(word, want):
    assert OverlapContext(check_peers=word).check_peers == want
    assert OverlapContext().check_peers == "once"


def test_check_peers_refuses_other_words():
    with pytest.raises(ValueError, match="once"):
        OverlapContext(check_peers="sometimes")


@pytest.mark.parametrize("bias", [True, False])
def test_rows_writer_writes_what_linear_gives_per_slice(bias):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(6, 3, 5, generator=g), torch.randn(7, 5, generator=g), torch.randn(7, generator=g)
    out = torch.full((6, 3, 7), float("nan"))
    write = rows_writer(out, w, b if bias else None)
    write((0, 2), x[0:2])
    write((2, 6), x[2:6])
    bias_ = b if bias else None
    # each slice is exactly what F.linear gives for those rows (the same mm / addmm on the same rows) ...
    assert torch.equal(out, torch.cat([F.linear(x[0:2], w, bias_), F.linear(x[2:6], w, bias_)]))
    # ... and close to one F.linear over all rows: a BLAS may pick another kernel for another row count
    # (MKL on AVX-512 does), so the last bits of a dot product may differ; fp32, K = 5: 1e-6 relative
    torch.testing.assert_close(out, F.linear(x, w, bias_), rtol=1e-6, atol=1e-6)


def test_schedules_and_merges_are_built_once():
    a = schedule(all_gather_ring, 1, 4, bidirectional=False, tag=1)
    assert a is schedule(all_gather_ring, 1, 4, bidirectional=False, tag=1)
    assert a == all_gather_ring(1, 4, tag=1)  # the cached object is the builder's data
    r = schedule(reduce_scatter_ring, 1, 4, bidirectional=False, tag=0)
    assert merged(r, a) is merged(r, a)
    assert prepare(merged(r, a)) is prepare(merged(r, a))


def test_a_buffer_first_made_under_inference_mode_is_writable_in_training_after():
    ctx, cpu = OverlapContext(), torch.device("cpu")
    with torch.inference_mode():  # Megatron's inference engine decodes under inference_mode
        first = ctx.buffer("rs.acc.0.0", (4, 3), torch.float32, cpu)
        first.fill_(1.0)
    again = ctx.buffer("rs.acc.0.0", (4, 3), torch.float32, cpu)  # the same buffer, now outside: training
    assert again.data_ptr() == first.data_ptr() and not again.is_inference()
    torch.mm(torch.ones(4, 2), torch.ones(2, 3), out=again)  # what a GEMM slice writer does; raised before
    assert torch.equal(again, torch.full((4, 3), 2.0))
