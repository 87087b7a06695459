"""Print and validate a schedule grid:
`python -m megatron_flashoverlap.schedules {ag,rs,a2a-produce,a2a-consume,moe,ar-<word>} P [--bidir] [--chunks C]
[--local G]`, ar-<word> for every all-reduce word of schedules.ALL_REDUCE (ar-ring, ar-hierarchical, ...)."""
import argparse

from . import (
    ALL_REDUCE, all_gather_ring, all_to_all_consume, all_to_all_produce, expert_pipeline, grid, reduce_scatter_ring,
    validate,
)

BUILDERS = {"ag": all_gather_ring, "rs": reduce_scatter_ring, "a2a-produce": all_to_all_produce,
            "a2a-consume": all_to_all_consume, "moe": expert_pipeline}
ALL_REDUCE_BUILDERS = {f"ar-{word}": w.build for word, w in ALL_REDUCE.items()}  # (rank, P, G, *, tag)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("op", choices=sorted(BUILDERS) + sorted(ALL_REDUCE_BUILDERS))
    ap.add_argument("world_size", type=int)
    ap.add_argument("--bidir", action="store_true", help="bidirectional ring (ag, rs)")
    ap.add_argument("--chunks", type=int, default=1, help="sub-chunks per hop (ag, rs; one-directional ring)")
    ap.add_argument("--local", type=int, default=None, help="ranks per node (ar-<word>; default: one node)")
    a = ap.parse_args(argv)
    kw = {"bidirectional": True} if a.bidir else {}
    if a.chunks != 1:
        kw["chunks"] = a.chunks
    if a.op in ALL_REDUCE_BUILDERS:
        scheds = [ALL_REDUCE_BUILDERS[a.op](r, a.world_size, a.local or a.world_size) for r in range(a.world_size)]
    else:
        scheds = [BUILDERS[a.op](r, a.world_size, **kw) for r in range(a.world_size)]
    validate(scheds)
    print(grid(scheds))
    print("validated: every send matched, no deadlock, every slice computed once, sums complete")


if __name__ == "__main__":
    main()
