"""Tier: Megatron DDP + DistributedOptimizer on 2 and 4 gloo CPU processes (both lanes), and the bare
`matmul_wgrad_reduce_scatter` operator. Stock Megatron (bucketed reduce-scatter after the backward) vs
the flash DP overlap (each weight's reduce-scatter inside its wgrad GEMM), same seeds, same data."""
import pytest
import torch

# fp32, DP=2: the ring adds two partials (commutative, so the same sum) but the wgrad GEMM is cut into
# row slices along the shards, which may change the GEMM's blocking: close, not bitwise
FP32 = 1e-6


def _close(a, b, tol):
    return max((a[n] - b[n]).abs().max().item() / max(1.0, b[n].abs().max().item()) for n in b) <= tol


@pytest.mark.parametrize("n,k,pad", [(4, 8, 0), (5, 7, 3), (24, 10, 64)])  # aligned, rows cut by shards
@pytest.mark.parametrize("algo", ["flash", "flash_bidir"])
def test_operator_matches_megatron_order(pools, n, k, pad, algo):
    for r in pools(2).run("tests.megatron.mp_ddp:operator", n, k, pad, algo=algo):
        assert r["err"] <= FP32 * max(1.0, r["scale"]), r


def test_operator_four_ranks(pools):
    for r in pools(4).run("tests.megatron.mp_ddp:operator", 6, 5, 1):
        assert r["err"] <= FP32 * max(1.0, r["scale"]), r


@pytest.mark.parametrize("world,chunks", [(2, 2), (2, 3), (4, 2)])
@pytest.mark.parametrize("n,k,pad", [(5, 7, 3), (24, 10, 64)])  # rows cut by shards and by pieces; padding
def test_operator_hop_chunks_match_megatron_order(pools, world, chunks, n, k, pad):
    # each shard made and sent in `chunks` pieces: same partials, GEMM cut in more row slices (FP32, above)
    for r in pools(world).run("tests.megatron.mp_ddp:operator", n, k, pad, hop_chunks=chunks):
        assert r["err"] <= FP32 * max(1.0, r["scale"]), r


@pytest.mark.parametrize("world,algo,chunks", [(2, "flash", 1), (3, "flash", 1), (4, "flash", 2),
                                               (4, "flash_bidir", 1)])
def test_operator_last_hop_deferred_until_finish(pools, world, algo, chunks):
    # defer_last: the GEMM has run, the own shard is complete only after finish() (the peers' partials are
    # added then); the same operations as the undeferred ring, so the same bits, and Megatron's order
    # within FP32
    for r in pools(world).run("tests.megatron.mp_ddp:operator", 5, 7, 3, algo=algo, hop_chunks=chunks, defer=True):
        assert not r["final_before"] and r["same"], r
        assert r["err"] <= FP32 * max(1.0, r["scale"]), r


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_operator_refuses_bad_hop_chunks(bad):
    from megatron_flashoverlap.ops import DPBucket, OpPlan
    from megatron_flashoverlap.ops.dp.wgrad_rs import matmul_wgrad_reduce_scatter
    with pytest.raises(ValueError, match="hop_chunks .*must be an integer >= 1"):
        matmul_wgrad_reduce_scatter(torch.zeros(2, 3), torch.zeros(2, 4), DPBucket(torch.zeros(12), 0), None,
                                    plan=OpPlan(hop_chunks=bad))


def _check_same(res, steps, weights_per_rank):
    for r in res:
        st, fl = r["stock"], r["flash"]
        assert fl["accepted"] == weights_per_rank and fl["fused_calls"] == steps * weights_per_rank, fl
        assert len(fl["buckets"]) > len(st["buckets"])  # the selected weights got buckets of their own
        assert _close(fl["params"], st["params"], FP32 * 10), "parameters differ from stock"
        assert all(abs(a - b) <= FP32 * 10 * max(1.0, abs(b)) for a, b in zip(fl["losses"], st["losses"]))
        assert not r["log"]


def test_dp2_one_step_parameters_equal_stock(pools):
    res = pools(2).run("tests.megatron.mp_ddp:train", tp=1, steps=1, layers=2, timeout=300)
    _check_same(res, 1, 4)
    assert all(r["dp"] == 2 for r in res)


@pytest.mark.parametrize("asynchronous", [None, False])  # gloo's default (the DP worker) and rings in backward
def test_dp2_twenty_steps_adam_micro_batches_same_loss_curve(pools, asynchronous):
    res = pools(2).run("tests.megatron.mp_ddp:train", tp=1, steps=20, micro=3, lr=1e-2, adam_eps=1e-8,
                       asynchronous=asynchronous, timeout=600)
    _check_same(res, 20, 2)
    assert res[0]["stock"]["losses"][-1] < res[0]["stock"]["losses"][0]  # it trains
    for r in res:  # in backward, the last ring's last hop is left to finish_grad_sync, which waits on it
        assert (r["flash"]["pending_after_backward"], r["flash"]["pending_after_finish"]) == \
            ((1, 0) if asynchronous is False else (0, 0)), r["flash"]


@pytest.mark.parametrize("asynchronous", [None, False])
def test_tp2_dp2_four_processes_parameters_equal_stock(pools, asynchronous):
    res = pools(4).run("tests.megatron.mp_ddp:train", tp=2, steps=2, micro=2, h=16, f=20, asynchronous=asynchronous,
                       timeout=600)
    _check_same(res, 2, 2)
    assert all(r["dp"] == 2 for r in res)


def test_rows_cut_by_shard_boundaries(pools):
    # W [f=25, h=10] -> 250 elements, bucket padded to 256: the DP shard boundary (128) falls mid-row
    res = pools(2).run("tests.megatron.mp_ddp:train", tp=1, steps=2, micro=2, h=10, f=25, timeout=300)
    _check_same(res, 2, 2)


def test_dp_group_of_one_falls_back_with_one_log_line(pools):
    res = pools(2).run("tests.megatron.mp_ddp:train", tp=2, steps=1, timeout=300)
    for r in res:
        assert r["dp"] == 1 and r["flash"]["accepted"] == 0 and r["flash"]["fused_calls"] == 0
        assert len(r["log"]) == 1 and "size 1" in r["log"][0], r["log"]
        assert _close(r["flash"]["params"], r["stock"]["params"], 0.0)  # the stock path itself: bitwise


def test_shared_bucket_falls_back_with_one_log_line(pools):
    # DDP built without isolated_buckets: the weights share buckets with other params -> stock, one line
    for r in pools(2).run("tests.megatron.mp_ddp:shared_bucket", timeout=300):
        assert r["accepted"] == 0 and len(r["log"]) == 1 and "shared" in r["log"][0], r["log"]
        assert r["reduced"] == 0  # no bucket group is ever skipped: Megatron's collective ran for all


def _grads_close(a, b, tol):
    return max((a[n] - b[n]).abs().max().item() / b[n].abs().max().item() for n in b) <= tol


def test_bf16_params_fp32_grad_buffers(pools):
    # bf16 params, grad_reduce_in_fp32: main_grad is fp32. The DP-reduced gradients (last step, before the
    # optimizer) are what the fused reduce-scatter makes: stock rounds each micro-batch's bf16 wgrad GEMM to
    # bf16 (2^-8 relative) before the fp32 add, ours sums the exact bf16 products in fp32, so 2 micro-batches
    # differ by about two roundings: 4 bf16 ulps of each tensor's max, 2^-6 (measured 1.5 ulps). A dW 5 % off
    # fails it (mutation dp_fused_grad_five_percent_low), which the parameters cannot show: 2 Adam steps move
    # them ~0.1 x grad, and their bf16 copies round at 2^-8 x |p| (one ulp, the 2^-7 below; measured 2^-11)
    res = pools(2).run("tests.megatron.mp_ddp:train", tp=1, steps=2, micro=2, dtype="bfloat16",
                       ddp_kw={"grad_reduce_in_fp32": True}, timeout=300)
    for r in res:
        assert r["flash"]["fused_calls"] == 2 * r["flash"]["accepted"] > 0
        assert _grads_close(r["flash"]["grads"], r["stock"]["grads"], 2 ** -6), "reduced gradients differ from stock"
        assert _close(r["flash"]["params"], r["stock"]["params"], 2 ** -7), "parameters differ from stock"


def test_average_in_collective(pools):
    res = pools(2).run("tests.megatron.mp_ddp:train", tp=1, steps=2, micro=2, ddp_kw={"average_in_collective": True},
                       timeout=300)
    _check_same(res, 2, 2)


def test_weight_used_twice_per_step_is_refused(pools):
    for r in pools(2).run("tests.megatron.mp_ddp:weight_used_twice", timeout=300):
        assert r["accepted"] == 1 and r["error"] and "used twice" in r["error"], r


def test_nan_check_blames_the_rank_that_made_it(pools):
    # as stock checks the local bucket before its collective: rank 0 (NaN local gradient) raises; rank 1,
    # whose reduced shard holds rank 0's NaN, does not
    r0, r1 = pools(2).run("tests.megatron.mp_ddp:nan_attribution", timeout=300)
    assert r0["accepted"] == r1["accepted"] == 1
    assert r0["error"] and "NaN" in r0["error"] and "local grad norm" in r0["error"], r0
    assert r1["error"] is None and r1["shard_nan"], r1
