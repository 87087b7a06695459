"""Tier: pure. The planner under FP8 (`--fp8`): the TP GEMMs at the FP8 rate, all-gathers of GEMM operands in FP8
bytes, reduce-scatter partials and everything else in bf16, the casts priced, the core attention in bf16."""
import math

from megatron_flashoverlap.plan import catalog, layer_times as layer, ops
from megatron_flashoverlap.plan.hardware import Cluster
from megatron_flashoverlap.plan.links import place
from megatron_flashoverlap.plan.model import Layout, Model
from megatron_flashoverlap.plan.price import Env

CLUSTER = Cluster(catalog.GPUS["h100"], catalog.LINKS["nvlink4"], catalog.LINKS["ib_ndr"], 8, 1, 8)
E8, E16 = Env(CLUSTER, "fp8"), Env(CLUSTER, "bf16")
G = place(8, 1, CLUSTER)
M, K, N = 8192, 8192, 28672  # Llama-3-70B's fc1 at s 8192


def test_fp8_moves_bf16_except_the_gathered_operands():
    assert (E8.act_dtype, E8.bytes, E8.gather_bytes) == ("bf16", 2, 1) and (E16.bytes, E16.gather_bytes) == (2, 2)
    assert E16.cast(1e6) == 0.0 and E8.cast(1e6) > 0.0


def test_the_gathers_carry_half_the_bytes_and_the_partials_the_same():
    # stock's collective alone (OpTimes.comm): an all-gather of x [M/P, K] per rank, a reduce-scatter of [M, N]
    assert math.isclose(ops.column_fwd(E8, G, M, K, N).comm, E8.net.collective("all_gather", M * K * 1, G))
    assert ops.column_fwd(E8, G, M, K, N).comm < ops.column_fwd(E16, G, M, K, N).comm
    assert math.isclose(ops.row_fwd(E8, G, M, N, K).comm, ops.row_fwd(E16, G, M, N, K).comm)
    assert math.isclose(ops.row_bwd(E8, G, M, N, K).comm, E8.net.collective("all_gather", M * K * 1, G))


def test_the_gemms_run_at_the_fp8_rate():
    # a GEMM this size is compute-bound: FP8's dense peak is twice bf16's on H100, so well under 0.75x
    assert ops.column_fwd(E8, G, M, K, N).compute < 0.75 * ops.column_fwd(E16, G, M, K, N).compute


def test_the_casts_are_priced_and_the_attention_stays_bf16():
    model = Model(hidden=8192, ffn=28672, heads=64, layers=80, seq=8192, query_groups=8, vocab=128256, swiglu=True)
    lay = Layout(tp=8, dp=1, sequence_parallel=True)
    (t8, b8), (t16, b16) = layer.fixed_time(E8, model, lay, 8192), layer.fixed_time(E16, model, lay, 8192)
    cf, cb = layer._fp8_casts(E8, model, lay, 8192)
    assert cf > 0 and cb > 0 and layer._fp8_casts(E16, model, lay, 8192) == (0.0, 0.0)
    assert math.isclose(b8 - b16, cb, rel_tol=1e-9)  # attention and the rest unchanged: only the casts
    assert math.isclose(t8 - t16, cf + cb, rel_tol=1e-9)
    # by hand, per rank at 8192 tokens, TP 8 + SP (x: a column's SP shard, a row's K shard; w: the rank's shard;
    # dy: the output gradient as the backward holds it): one kernel per tensor, 5 bytes an element over HBM
    x = 8192 * 8192 // 8 * 3 + 8192 * 28672 // 8  # qkv, proj, fc1, fc2
    w = 8192 * (64 + 16) * 128 // 8 + 8192 * 8192 // 8 + 8192 * 2 * 28672 // 8 + 28672 * 8192 // 8
    dy = 8192 * 10240 // 8 + 8192 * 8192 // 8 + 8192 * 57344 // 8 + 8192 * 8192 // 8
    g = E8.gemm
    assert math.isclose(cf, 8 * g.kernel + (x + w) * 5 / g.hbm) and math.isclose(cb, 4 * g.kernel + dy * 5 / g.hbm)
