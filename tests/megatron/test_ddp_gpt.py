"""Tier: a Megatron GPT (our spec) under DDP + DistributedOptimizer on 4 gloo CPU processes (TP2 x DP2, SP):
our TP linears reduce-scatter their weight gradient over DP inside their own wgrad walk. Stock (local spec,
Megatron's bucketed reduce-scatter) vs ours, same seeds, same data, 3 optimizer steps."""
import re

import pytest
import torch

# fp32 throughout; our TP rings (SP all-gather / reduce-scatter) and the DP ring reorder sums against
# stock's collectives, and Adam's step is ~ lr/eps * grad = 0.1 * grad, so parameters agree to ~1e-6 rel
TOL = 1e-5
# every fused weight must move by at least this (absolute; |params| <= ~1): 100 x TOL, so a fused gradient 1 %
# off moves it ~1e-5 away from stock's and fails TOL (mutation dp_fused_grad_one_percent_low: 1.8e-5 in
# test_explicit_choice, a thin margin: 2 % would be clearer). Measured:
# the linears' weights move 6e-3 to 1.5e-2 in 2 steps; the norms' biases (never fused) only 7e-5
MOVED = 100 * TOL
LINEARS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


def _close(a, b):
    return max((a[n] - b[n]).abs().max().item() / max(1.0, b[n].abs().max().item()) for n in b)


def _ours(fused):
    return {n: c for n, c in fused.items() if n.endswith(LINEARS)}


def _check(res, steps, expect_linears):
    for r in res:
        st, fl = r["stock"], r["flash"]
        assert r["dp"] == 2
        ours = _ours(fl["fused"])
        assert len(ours) == expect_linears and all(c == steps for c in ours.values()), fl["fused"]
        assert all(c == steps for c in fl["fused"].values()), fl["fused"]  # accepted means fused
        assert len(fl["buckets"]) <= len(st["buckets"]) + len(fl["fused"]), (st["buckets"], fl["buckets"])
        assert _close(fl["params"], st["params"]) <= TOL, "parameters differ from stock"
        moved = {n: st["moves"][n] for n in fl["fused"]}
        assert all(m > MOVED for m in moved.values()), moved  # the comparison of the fused weights is not vacuous
        assert min(st["moves"].values()) > 0, st["moves"]  # and every parameter moved


def test_tp2_dp2_sp_our_linears_fuse_and_train_like_stock(pools):
    res = pools(4).run("tests.megatron.mp_ddp_gpt:train", tp=2, sp=True, steps=3, timeout=900)
    _check(res, 3, 8)  # 2 layers x (qkv, proj, fc1, fc2), all in stock's single bucket
    assert res[0]["flash"]["asynchronous"] == [True]  # the default on gloo: the DP worker (megatron/ddp/worker.py)
    assert any("automatic" in line for line in res[0]["log"]), res[0]["log"]


def test_ring_in_backward_tp2_dp2_sp_trains_like_stock(pools):
    # asynchronous=False: each fused ring waited inside its layer's backward (the path NCCL's default shares)
    res = pools(4).run("tests.megatron.mp_ddp_gpt:train", tp=2, sp=True, steps=3, asynchronous=False, timeout=900)
    _check(res, 3, 8)
    assert res[0]["flash"]["asynchronous"] == [False]


def test_dp_worker_ring_dp2_trains_like_stock(pools):
    # asynchronous=True (megatron/ddp/worker.py), TP=1 x DP=2, several stock buckets beside the worker's rings
    res = pools(2).run("tests.megatron.mp_ddp_gpt:train", tp=1, sp=False, steps=3, asynchronous=True,
                       ddp_kw={"bucket_size": 3000}, linears=["layers.0.mlp.linear_fc1", "layers.0.mlp.linear_fc2",
                                                              "layers.1.mlp.linear_fc1"], timeout=600)
    assert res[0]["flash"]["asynchronous"] == [True]
    _check(res, 3, 3)


def test_automatic_choice_keeps_stock_buckets(pools):
    # bucket_size 3000: stock cuts several buckets; only the weights of its last one (first layer, embedding
    # side) are fused, and the other buckets keep their sizes
    res = pools(4).run("tests.megatron.mp_ddp_gpt:train", tp=2, sp=True, steps=3, ddp_kw={"bucket_size": 3000},
                       timeout=900)
    for r in res:
        st, fl = r["stock"], r["flash"]
        assert len(st["buckets"]) > 1 and 0 < len(fl["fused"]) < 9, (st["buckets"], fl["fused"])
        assert all(".layers.1." not in n for n in fl["fused"]), fl["fused"]  # the last layer stays stock
    _check(res, 3, len(_ours(res[0]["flash"]["fused"])))


# stock's reduce-scatter 1 us per gradient element, our ring and the GEMMs 1 ns, no call latency: stock's
# buckets are all exposed, each fused weight takes its elements off them, so the model's best is to fuse
# every candidate (the choice known in advance, by hand: 2 layers x qkv, proj, fc1, fc2 = 8 linears)
FIXED_RATES = (1e-6, 1e-9, 1e-9, 0.0)


@pytest.mark.parametrize("tp", [2, 1])
def test_cost_model_choice_is_logged_and_trains_like_stock(pools, tp):
    # tokens given: the cost model (megatron/ddp/auto_fuse.py) picks the linears. TP=2: calibrated on this box,
    # whatever it picks (0 to all 8 + output) must be what its line says and still equal stock; TP=1: fixed
    # rates (FIXED_RATES), where the count is known without the code under test
    fixed = FIXED_RATES if tp == 1 else None
    res = pools(2 * tp).run("tests.megatron.mp_ddp_gpt:train", tp=tp, sp=tp > 1, steps=2,
                            ddp_kw={"bucket_size": 3000}, tokens=32, rates=fixed, timeout=900)
    lines = [line for line in res[0]["log"] if "cost model" in line]
    assert len(lines) == 1 and "stock --overlap-grad-reduce" in lines[0], res[0]["log"]
    said = int(re.search(r"fusing the (\d+) of \d+ tensor-parallel", lines[0]).group(1))
    assert all(len(r["flash"]["fused"]) == said for r in res), (lines[0], res[0]["flash"]["fused"])  # as it says
    ours = 8 if fixed else len(_ours(res[0]["flash"]["fused"]))  # fixed: every layer's 4 linears (FIXED_RATES)
    # the model also placed the rings (plan/dp.worker_pays): the sites run where its line says
    placed = [True] if "on the DP worker thread" in lines[0] else [False]
    assert res[0]["flash"]["asynchronous"] in ([], placed), (res[0]["flash"]["asynchronous"], lines[0])
    if tp > 1:  # at TP > 1 the worker whatever the model finds (megatron/ddp/auto_fuse.auto_linears)
        assert "on the DP worker thread" in lines[0], lines[0]
    for r in res:  # the fused linears are those reduced last in backward: layer 1 only after layer 0
        fused = r["flash"]["fused"]
        assert not any(".layers.1." in n for n in fused) or any(".layers.0." in n for n in fused), fused
    _check(res, 2, ours)


def test_explicit_choice(pools):
    res = pools(4).run("tests.megatron.mp_ddp_gpt:train", tp=2, sp=True, steps=2,
                       linears=["layers.0.mlp.linear_fc2"], timeout=900)
    _check(res, 2, 1)


def test_tp2_dp2_without_sp(pools):
    res = pools(4).run("tests.megatron.mp_ddp_gpt:train", tp=2, sp=False, steps=2, timeout=900)
    _check(res, 2, 8)


def _has_full_param_layout():
    from megatron.core.distributed import DistributedDataParallel
    import inspect
    return "full_param_layout" in inspect.signature(DistributedDataParallel.__init__).parameters


@pytest.mark.skipif(not _has_full_param_layout(), reason="megatron-core < 0.19 has no full_param_layout")
def test_precomputed_full_param_layout_fuses(pools):
    res = pools(4).run("tests.megatron.mp_ddp_gpt:train", tp=2, sp=True, steps=2, layout=True,
                       ddp_kw={"bucket_size": 40000000}, timeout=900)
    _check(res, 2, 8)
    assert not any("stay on Megatron" in line for line in res[0]["log"]), res[0]["log"]


def test_dp_worker_ring_tp2_dp2_sp_trains_like_stock(pools):
    # asynchronous=True at TP2 x DP2 + SP (megatron/ddp/worker.py): all 8 linears fused, so the worker's DP rings of
    # layer 1 run while backward's TP rings of layer 0 post on the TP group; small buckets keep stock
    # buckets (their collectives on the DP group) beside them
    linears = [f"layers.{k}.{m}" for k in (0, 1) for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                          "mlp.linear_fc1", "mlp.linear_fc2")]
    res = pools(4).run("tests.megatron.mp_ddp_gpt:train", tp=2, sp=True, steps=3, asynchronous=True,
                       ddp_kw={"bucket_size": 3000}, linears=linears, timeout=600)
    assert res[0]["flash"]["asynchronous"] == [True]
    _check(res, 3, 8)
