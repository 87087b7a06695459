"""Worker bodies: Megatron DDP + DistributedOptimizer, stock vs the flash DP reduce-scatter (gloo ranks).

`train` builds the same tiny tensor-parallel MLP twice from one seed (stock DDP; DDP through
`wrap_with_dp_overlap`), trains each for `steps` optimizer steps of `micro` micro-batches (all but the
last under `no_sync`, as Megatron's schedules do) and returns losses, final parameters and counters.
Data differ per DP rank and agree across the TP ranks of one DP rank.
"""
from __future__ import annotations

import torch

from tests.support.loglines import Lines as _Lines

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _setup(tp):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_flashoverlap.megatron import cpu

    cpu.enable()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    return ps


class MLP(torch.nn.Module):
    def __init__(self, cfg, h, f, layers):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        super().__init__()
        init = torch.nn.init.xavier_normal_
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleList([
                ColumnParallelLinear(h, f, config=cfg, init_method=init, bias=True, gather_output=False),
                RowParallelLinear(f, h, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                  skip_bias_add=False)]))

    def forward(self, x):
        for fc1, fc2 in self.blocks:
            y, _ = fc1(x)
            x = x + fc2(torch.nn.functional.gelu(y))[0]
        return x


def _build(mode, cfg, h, f, layers, ddp_kw, opt_kw, seed, asynchronous=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_flashoverlap.megatron.ddp.wrap import wrap_with_dp_overlap

    torch.manual_seed(seed)
    module = MLP(cfg, h, f, layers)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, **ddp_kw)
    if mode == "stock":
        ddp, accepted = DistributedDataParallel(cfg, ddp_cfg, module), []
    else:
        ddp, accepted = wrap_with_dp_overlap(cfg, ddp_cfg, module, asynchronous=asynchronous)
    opt = get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=True, **opt_kw), [ddp])
    return module, ddp, opt, accepted


def _run(ps, mode, cfg, h, f, layers, steps, micro, s, b, ddp_kw, opt_kw, dtype, asynchronous=None):
    from megatron_flashoverlap.megatron.ddp import grad_sync as megatron_ddp

    module, ddp, opt, accepted = _build(mode, cfg, h, f, layers, ddp_kw, opt_kw, seed=7, asynchronous=asynchronous)
    dp_rank = ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(100 + dp_rank)
    losses = []
    for step in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        total = 0.0
        for m in range(micro):
            x = torch.randn(s, b, h, generator=g).to(dtype)
            target = torch.randn(s, b, h, generator=g).to(dtype)
            sync = ddp.no_sync() if m < micro - 1 else _null()
            with sync:
                loss = (ddp(x).float() - target.float()).pow(2).mean() / micro
                loss.backward()
            total += loss.item()
        pending = len(megatron_ddp._PENDING)  # in-backward rings whose last hop is not yet waited
        ddp.finish_grad_sync()
        if step == steps - 1:
            grads = _reduced_grads(ddp, module, ps.get_data_parallel_group())
        opt.step()
        losses.append(total)
    params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    fused = sum(w._flashoverlap_dp.fused_calls for w in accepted)
    buckets = [len(bk.params_list) for buf in ddp.buffers for bk in buf.buckets]
    return {"losses": losses, "params": params, "accepted": len(accepted), "fused_calls": fused, "grads": grads,
            "buckets": buckets, "pending_after_backward": pending, "pending_after_finish": len(megatron_ddp._PENDING)}


def _reduced_grads(ddp, module, dp_group) -> dict:
    """{name: the DP-reduced main_grad [param's shape]} after finish_grad_sync: each bucket's reduced shards
    all-gathered over DP (each rank holds only its own), then cut per parameter (bucket layouts differ
    between stock and flash, parameter names do not)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    names = {id(p): n for n, p in module.named_parameters()}
    out = {}
    for buf in ddp.buffers:
        for bk in buf.buckets:
            data = bk.grad_data
            shard = data.numel() // world
            full = torch.empty_like(data)
            dist.all_gather_into_tensor(full, data[rank * shard:(rank + 1) * shard].contiguous(), group=dp_group)
            for p in bk.params_list:
                at = (p.main_grad.data_ptr() - data.data_ptr()) // data.element_size()
                out[names[id(p)]] = full[at:at + p.numel()].view(p.shape).float().clone()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def train(rank, world, tp=1, steps=1, micro=1, h=16, f=24, layers=1, s=4, b=2, lr=10.0, adam_eps=100.0,
          dtype="float32", ddp_kw=None, modes=("stock", "flash"), asynchronous=None):
    """-> {mode: {"losses", "params", "accepted", "fused_calls", "buckets"}, "log": [lines]}.

    Adam (the DistributedOptimizer supports no SGD); by default with eps >> |grad| so that one step moves
    each parameter by ~ lr/eps * grad: a gradient difference shows up in the parameters."""
    from megatron.core.transformer import TransformerConfig

    from megatron_flashoverlap.megatron.ddp import grad_sync as megatron_ddp

    ps = _setup(tp)
    lines = _Lines()
    megatron_ddp.log.addHandler(lines)
    try:
        dt = DT[dtype]
        cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, use_cpu_initialization=True,
                                params_dtype=dt, tensor_model_parallel_size=tp, bf16=dt == torch.bfloat16)
        bf16 = dt == torch.bfloat16
        opt_kw = {"optimizer": "adam", "lr": lr, "adam_eps": adam_eps, "bf16": bf16, "params_dtype": dt,
                  "clip_grad": 1.0}
        out = {mode: _run(ps, mode, cfg, h, f, layers, steps, micro, s, b, dict(ddp_kw or {}), opt_kw, dt,
                          asynchronous) for mode in modes}
        out["log"] = lines.lines
        out["dp"] = ps.get_data_parallel_world_size()
        return out
    finally:
        megatron_ddp.log.removeHandler(lines)
        ps.destroy_model_parallel()


def operator(rank, world, n, k, pad, s=3, b=2, algo="flash", seed=0, scale=0.5, dtype="float32", hop_chunks=1,
             defer=False):
    """The bare operator on a flat bucket [offset pad | W n*k | tail pad] vs stock (add, scale, RS).
    defer: the ring's last hop deferred (defer_last=True): "final_before" = the own shard held the result
    before finish(), "same" = the result equals the undeferred ring's bitwise (the same operations)."""
    from megatron_flashoverlap.ops.dp.wgrad_rs import DPBucket, matmul_wgrad_reduce_scatter
    from megatron_flashoverlap.ops.registry import OpPlan
    import torch.distributed as dist

    dt = DT[dtype]
    g = torch.Generator().manual_seed(seed + rank)
    dy, x = torch.randn(s, b, n, generator=g).to(dt), torch.randn(s, b, k, generator=g).to(dt)
    length = -(-(pad + n * k) // world) * world + world  # padded, divisible by the group size
    base = torch.randn(length, generator=g).to(dt)  # gradient accumulated by earlier micro-batches
    ref, got = base.clone(), base.clone()
    matmul_wgrad_reduce_scatter(dy, x, DPBucket(ref, pad, scale), dist.group.WORLD, algo="reference")
    plan = OpPlan(algo, hop_chunks=hop_chunks if algo == "flash" else None)
    shard = length // world
    own = slice(rank * shard, (rank + 1) * shard)
    out = {}
    if defer:
        now = base.clone()
        matmul_wgrad_reduce_scatter(dy, x, DPBucket(now, pad, scale), dist.group.WORLD, plan=plan)
        finish = matmul_wgrad_reduce_scatter(dy, x, DPBucket(got, pad, scale), dist.group.WORLD, plan=plan,
                                             defer_last=True)
        out["final_before"] = torch.equal(got[own], now[own])  # the last hop's add not yet made
        finish()
        finish()  # a second call does nothing
        out["same"] = torch.equal(got[own], now[own])
    else:
        matmul_wgrad_reduce_scatter(dy, x, DPBucket(got, pad, scale), dist.group.WORLD, plan=plan)
    return {"err": (got[own].double() - ref[own].double()).abs().max().item(),
            "scale": ref[own].abs().max().item(), **out}


def shared_bucket(rank, world, h=16, f=24):
    """DDP built the stock way (no bucket isolation), then asked for the overlap: refused, one log line."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_flashoverlap.megatron.ddp import grad_sync as megatron_ddp

    ps = _setup(1)
    lines = _Lines()
    megatron_ddp.log.addHandler(lines)
    try:
        cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, use_cpu_initialization=True)
        module = MLP(cfg, h, f, 1)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                         overlap_grad_reduce=True), module)
        accepted = megatron_ddp.enable_dp_overlap(ddp, [blk[0].weight for blk in module.blocks])
        ddp(torch.randn(4, 2, h)).sum().backward()
        ddp.finish_grad_sync()
        reduced = sum(bool(getattr(g, "_flashoverlap_reduced", False)) for g in ddp.bucket_groups)
        return {"accepted": len(accepted), "log": lines.lines, "reduced": reduced}
    finally:
        megatron_ddp.log.removeHandler(lines)
        ps.destroy_model_parallel()


def weight_used_twice(rank, world, h=8, f=8):
    """A flash weight used twice in one micro-batch: the second wgrad must refuse, naming the fix."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_flashoverlap.megatron.ddp.wrap import wrap_with_dp_overlap

    ps = _setup(1)
    try:
        cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, use_cpu_initialization=True)
        module = MLP(cfg, h, f, 1)
        fc1, fc2 = module.blocks[0]
        ddp, accepted = wrap_with_dp_overlap(cfg, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True), module, linears=[fc2])
        x = torch.randn(4, 2, f)
        try:
            (fc2(fc2(x)[0])[0]).sum().backward()  # fc2 [h, f] with h == f: reused on its own output
        except RuntimeError as err:
            return {"accepted": len(accepted), "error": str(err)}
        return {"accepted": len(accepted), "error": None}
    finally:
        ps.destroy_model_parallel()


def nan_attribution(rank, world, h=8, f=16):  # W [16, 8] fills both DP shards of its bucket
    """DP=2, one fused weight (the model's only parameter); rank 0's output gradient is NaN, so only rank 0's
    LOCAL weight gradient is NaN. -> {"error": the check's message or None, "shard_nan": NaN in the own
    reduced shard (what a check after the reduce-scatter would have seen)}."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from megatron_flashoverlap.megatron.ddp.wrap import wrap_with_dp_overlap

    ps = _setup(1)
    try:
        cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=2, use_cpu_initialization=True)
        fc = ColumnParallelLinear(h, f, config=cfg, init_method=torch.nn.init.xavier_normal_, bias=False,
                                  gather_output=False)
        ddp, accepted = wrap_with_dp_overlap(cfg, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, check_for_nan_in_grad=True), fc, linears=[fc])
        y, _ = ddp(torch.randn(4, 2, h))
        if rank == 0:
            y.register_hook(lambda g: g * float("nan"))
        error = None
        try:
            y.sum().backward()
            ddp.finish_grad_sync()
        except RuntimeError as err:
            error = str(err)
        grads = ddp.buffers[0].grad_data  # one bucket: this weight, padded
        shard = grads.numel() // world
        own = grads[rank * shard:(rank + 1) * shard]
        return {"accepted": len(accepted), "error": error, "shard_nan": bool(own.isnan().any()),
                "fused": fc.weight._flashoverlap_dp.fused_calls}
    finally:
        ps.destroy_model_parallel()
