"""Where the fused weights sit in Megatron's gradient buffer, and which weights to fuse.

Megatron's buffer lays parameters out in reverse `named_parameters()` order (backward order) and cuts a
bucket once it holds `bucket_size` elements or at a param tagged `shared_embedding` (before and after it;
megatron-core 0.16.1 in `_ParamAndGradBuffer`, 0.19.2 in `DistributedOptimizer._compute_per_buffer_param_
layout`). A fused weight needs a bucket of its own (its reduce-scatter runs inside its wgrad GEMM), and the
bucket ids must rise in that order, so tagging the weights in place would cut every run of biases and norms
between them into a bucket of its own. `isolated_buckets(module, weights)` therefore also moves the weights
to the END of the layout order (the start of `named_parameters()`) while DDP is built:

    layout order  | stock buckets of all other params (normal sizes) | [w_1] | [w_2] | ... | [w_F] |
    buckets       <= stock's count + F

With a precomputed 0.19 `full_param_layout` (Megatron's recommended path) `relayout` rewrites it the same
way: the other params keep the caller's bucket boundaries, every fused weight gets one bucket after them.

`last_bucket_weights(...)`: the automatic choice. Stock `--overlap-grad-reduce` hides a bucket's
reduce-scatter behind the backward of the layers before it; the bucket reduced LAST (the first layers and
the embedding) has nothing left to hide behind and is exposed. So the candidates in stock's last bucket are
fused, all others stay on Megatron's bucketed overlap.
"""
from __future__ import annotations

import contextlib

from ...plan.dp import megatron_bucket_size


def _trainable(module) -> list:
    return [p for _, p in module.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def isolated_buckets(module, weights):
    """Build DDP inside this block: each of `weights` gets a bucket of its own, the other params keep
    stock's buckets (module docstring). Tags and the reordering are removed afterwards."""
    ids = {id(w) for w in weights}
    tagged = [w for w in weights if not getattr(w, "shared_embedding", False)]
    original = module.named_parameters

    def named_parameters(*args, **kwargs):
        items = list(original(*args, **kwargs))
        return iter([i for i in items if id(i[1]) in ids] + [i for i in items if id(i[1]) not in ids])

    for w in tagged:
        w.shared_embedding = True
    module.named_parameters = named_parameters
    try:
        yield
    finally:
        del module.named_parameters
        for w in tagged:
            del w.shared_embedding


def _pack(groups, dp_size: int, pad_busbw: bool):
    """Lay out `groups` (lists of params, one bucket each) with Megatron's padding -> layout fields."""
    from megatron.core.optimizer.param_layout import pad_bucket_end, pad_param_start

    index, buckets, unpadded, start = {}, [], [], 0
    for bucket_id, group in enumerate(groups):
        bucket_start = cur = start
        for p in group:
            cur = pad_param_start(cur)
            index[p] = (cur, cur + p.data.nelement(), bucket_id)
            cur += p.data.nelement()
        unpadded.append(cur - bucket_start)
        start = pad_bucket_end(cur, dp_size, pad_busbw)
        buckets.append((bucket_start, start))
    return index, buckets, unpadded


def _groups(layout, order, fused_ids):
    """The caller's buckets of the non-fused params (in layout order), then one bucket per fused weight."""
    groups, last = [], None
    for p in order:
        if id(p) in fused_ids:
            continue
        bucket = layout.param_index_map[p][2]
        if bucket != last:
            groups.append([])
            last = bucket
        groups[-1].append(p)
    return groups + [[p] for p in order if id(p) in fused_ids]


def relayout(full_layout, module, weights, ddp_config):
    """A megatron-core >= 0.19 FullParamLayout for DDP built inside `isolated_buckets(module, weights)`:
    the caller's layout with every weight of `weights` moved into a bucket of its own (module docstring)."""
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
    from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout

    fused_ids = {id(w) for w in weights}
    params = [p for p in _trainable(module) if id(p) in fused_ids] + \
             [p for p in _trainable(module) if id(p) not in fused_ids]
    out = {}
    for key, (group_params, indices) in group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32).items():
        old = full_layout.layouts.get(key)
        if old is None or set(old.param_index_map) != set(group_params):
            raise ValueError("full_param_layout does not match the model's parameters; compute it with "
                             "DistributedOptimizer.compute_full_param_layout over this model's parameters")
        index, buckets, unpadded = _pack(_groups(old, group_params[::-1], fused_ids), old.num_optimizer_shards,
                                         ddp_config.pad_buckets_for_high_nccl_busbw)
        out[key] = PerBufferParamLayout(param_index_map=index, bucket_indices=buckets,
                                        per_bucket_numel_unpadded=unpadded, param_indices=indices,
                                        num_optimizer_shards=old.num_optimizer_shards)
    return FullParamLayout(layouts=out)


def stock_bucket_size(ddp_config, dp_size: int) -> int | None:
    """The bucket size Megatron's DDP uses (its constructor's default rule; None = one bucket)."""
    if not ddp_config.overlap_grad_reduce:
        return None
    return ddp_config.bucket_size if ddp_config.bucket_size is not None else megatron_bucket_size(dp_size)


def last_bucket_weights(module, candidates, bucket_size: int | None) -> list:
    """The candidates that stock's layout puts in its last bucket (the one reduced last in backward).
    Basis: stock's bucketing rule (size only; dtype buffers are laid out alike), walked in layout order."""
    ids = {id(w) for w in candidates}
    bucket, filled = [], 0
    for p in reversed(_trainable(module)):
        if bucket_size is not None and filled >= bucket_size:
            bucket, filled = [], 0
        bucket.append(p)
        filled += p.data.nelement()
    return [p for p in bucket if id(p) in ids][::-1]
