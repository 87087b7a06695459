"""Worker-side body of tests/megatron/test_probe.py: the start-up probe's measurement on the pool's gloo group."""
from __future__ import annotations

import os


def figures(rank, world):
    """The probe's figures for a small TP = world layout (each rank its own node's neighbour) -> (figures,
    the shapes asked for, the planner's choices on them)."""
    from megatron_flashoverlap.megatron.probe import measure
    from megatron_flashoverlap.plan.probe_plan import choose, probe_shapes
    from megatron_flashoverlap.plan.model import Layout, Model

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    model, layout = Model(hidden=128, ffn=512, heads=4, layers=2, seq=64), Layout(tp=world, dp=1)
    shapes = probe_shapes(model, layout)
    got = measure(shapes, gpus_per_node=world)
    c = choose(got, model, layout)
    # the clock measures work: a GEMM of 2^15 x the FLOPs of another (the model's shapes are too close in size
    # for their times to order reliably on a shared host)
    work = measure([(16, 16, 16), (512, 512, 512)], gpus_per_node=world, hop_bytes=(1 << 16,))["gemm"]
    return got, [list(s) for s in shapes], {"sites": sorted(c.sites), "table": c.decode_table["tables"][0],
                                            "work": work}
