"""The MoE exchange of a layer whose moe.algo is auto: stock or ours, the chooser's measured tier (plan/chooser.py).

    moe_pick(chooser, moe_key(rows, h, experts, layout, members), tokens [n, h], probs [n],
             (experts, counts [P][E], input_splits [P]), group, ctx, replicas=None) -> "reference" | "flash"
        (where flash cannot fuse, the layer keeps stock without asking: the pairwise exchange alone puts no
        compute between its steps)
        key: moe/train/<bucket of n>; where no higher tier answers and the budget allows, the two candidates run
        in paired rounds (runtime/timing.py `paired`) on the layer's own routed tokens, FORWARD only under no_grad:
            reference   expert_pipeline "reference": stock's all-to-all, the experts on every row, all-to-all back
            flash       expert_pipeline "flash": the fused walk, each source block through the experts on arrival
        A forward + backward probe would fire Megatron DDP's gradient hooks on the experts' parameters (and add
        into their main_grad), which a measurement must not touch; the backward is the forward's dual walk (the
        same hops, each block's expert backward under them). The samples are the max over the EP group and
        `replicas` (the expert-data-parallel group): every replica takes the same choice.
"""
from __future__ import annotations

import torch

from ...config import MOE_SITE
from ...plan.chooser import Chooser, Key, Measured, bucket
from ...runtime.timing import paired
from ..choose import ROUNDS, WARMUP, settle
from .fused import LocalExperts, expert_pipeline

def moe_key(rows: int, h: int, experts: int, layout: str, members: tuple) -> Key:
    """moe/train/<bucket of the routed rows> on `layout` (ops/choose.py group_layout of the EP group)."""
    return Key(MOE_SITE, "train", bucket(rows), layout, f"h {h} experts {experts}", members)


def moe_pick(chooser: Chooser, key: Key, tokens: torch.Tensor, probs: torch.Tensor,
             pipeline: tuple[LocalExperts, object, object], group, ctx, replicas=None) -> str:
    """The algorithm the layer runs for `key` (module docstring). Collective under measurement: every rank of
    the EP group (and of `replicas`) reaches it at the same layer's first training forward."""
    known = chooser.answer(key)
    if known is None:
        def measure():
            def run(algo):
                return lambda: expert_pipeline(tokens, probs, *pipeline, group, ctx, algo=algo)
            with torch.no_grad():
                return Measured.of(paired({"reference": run("reference"), "flash": run("flash")}, group,
                                          tokens.device, rounds=ROUNDS, warmup=WARMUP, replicas=replicas))
        known = settle(chooser, key, tokens.device, group, measure)
    return known.pick
