"""The option objects of the pipeline API (runtime/pipeline.py): one small value per concern, built once by the
operator and handed down, instead of a dozen loose keywords.

    Ring(bidirectional, hop_chunks, name, tag)   what a pass's transfers need: one direction or both, row
                                                 sub-chunks per hop (each its own transfer, posted ahead), the
                                                 name its buffers take in the context, the tag of its slices
                                                 in a merged walk
    Producer(fn, into, own_into)                 what the Flash-RS compute closure is: fn(rows) -> partial
                                                 [rows, *tail], or with `into` fn(rows, out) writes it into the
                                                 ring slot `out`; own_into [block_rows, *tail] (acc == out
                                                 dtype): the own block is made, summed and returned there
    Sums(acc, out, wire, device)                 how reduce-scatter partials add up: kept in `acc`, sent in
                                                 `wire`, returned in `out` (runtime.numerics.sums builds it)

NamedTuples: immutable, hashable where their fields are, and as cheap to make per call as a tuple.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class Ring(NamedTuple):
    bidirectional: bool = False
    hop_chunks: int = 1
    name: str = "ring"
    tag: int = 0


class Producer(NamedTuple):
    fn: Callable
    into: bool = False
    own_into: torch.Tensor | None = None


class Sums(NamedTuple):
    acc: torch.dtype
    out: torch.dtype
    wire: torch.dtype
    device: torch.device


AG = Ring(name="ag")  # the default all-gather pass
RS = Ring(name="rs")  # the default reduce-scatter pass
