"""Ulysses attention's all-to-all where attention.ulysses_algo is auto: stock or ours, the chooser's measured tier
(plan/chooser.py).

    ulysses_pick(chooser, ulysses_key(q_s, k_s, layout, members), (q_s, k_s, v_s), attend, group, ctx,
                 replicas=None) -> "reference" | "flash"
        q_s [s/P, b, np, hn], k_s / v_s [s/P, b, ng, hn]: this call's shards
        key: ulysses/train/<bucket of s/P * b>; where no higher tier answers and the budget allows, forward +
        backward of ulysses_attention with each algorithm, in paired rounds on detached copies of q, k, v:
            reference   all_to_all_single around the attention (stock's Ulysses)
            flash       the pairwise walk on the executor
        Core attention has no parameters, so the probe touches nothing of the model; its dropout is off, so it
        draws no random number (the model's dropout stream stays stock's). The two move the same bytes to the
        same places: the choice changes the time, never a value. The samples are the max over the CP group and
        `replicas`: every rank takes the same choice.
"""
from __future__ import annotations

import dataclasses

import torch

from ...config import ULYSSES_SITE
from ...plan.chooser import Chooser, Key, Measured, bucket
from ...runtime.timing import paired
from ..choose import ROUNDS, WARMUP, settle
from .core import Attend
from .ulysses import ulysses_attention


def ulysses_key(q_s: torch.Tensor, k_s: torch.Tensor, layout: str, members: tuple) -> Key:
    """ulysses/train/<bucket of s/P * b> on `layout` (ops/choose.py group_layout of the CP group), the heads'
    sizes."""
    return Key(ULYSSES_SITE, "train", bucket(q_s.shape[0] * q_s.shape[1]), layout,
               f"np {q_s.shape[2]} ng {k_s.shape[2]} hn {q_s.shape[3]}", members)


def ulysses_pick(chooser: Chooser, key: Key, qkv: tuple, attend: Attend, group, ctx, replicas=None) -> str:
    """The a2a algorithm for `key` (module docstring). Collective under measurement: every rank of the CP group
    (and of `replicas`) reaches it at the same layer's first training forward."""
    known = chooser.answer(key)
    if known is None:
        probe = dataclasses.replace(attend, dropout_p=0.0, seed=0)

        def run(algo):
            def once():
                q, k, v = (t.detach().requires_grad_() for t in qkv)
                out = ulysses_attention(q, k, v, group, attend=probe, algo=algo, context=ctx)
                out.backward(torch.ones_like(out))
            return once

        def measure():
            with torch.enable_grad():
                return Measured.of(paired({"reference": run("reference"), "flash": run("flash")}, group,
                                          qkv[0].device, rounds=ROUNDS, warmup=WARMUP, replicas=replicas))
        known = settle(chooser, key, qkv[0].device, group, measure)
    return known.pick
