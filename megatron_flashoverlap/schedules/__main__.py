"""Print and validate a schedule grid:
`python -m megatron_flashoverlap.schedules {ag,rs,a2a-produce,a2a-consume,moe,ar-ring,ar-rd,ar-hier,ar-hier-pipe,ar-hier-hd} P
[--bidir] [--chunks C] [--local G]`."""
import argparse

from . import (
    all_gather_ring, all_reduce_hierarchical, all_reduce_hierarchical_hd, all_reduce_hierarchical_pipelined, all_reduce_recursive_doubling,
    all_reduce_ring, all_to_all_consume, all_to_all_produce, expert_pipeline, grid, reduce_scatter_ring, validate,
)

BUILDERS = {"ag": all_gather_ring, "rs": reduce_scatter_ring, "a2a-produce": all_to_all_produce,
            "a2a-consume": all_to_all_consume, "moe": expert_pipeline, "ar-ring": all_reduce_ring,
            "ar-rd": all_reduce_recursive_doubling, "ar-hier": all_reduce_hierarchical,
            "ar-hier-pipe": all_reduce_hierarchical_pipelined, "ar-hier-hd": all_reduce_hierarchical_hd}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("op", choices=sorted(BUILDERS))
    ap.add_argument("world_size", type=int)
    ap.add_argument("--bidir", action="store_true", help="bidirectional ring (ag, rs)")
    ap.add_argument("--chunks", type=int, default=1, help="sub-chunks per hop (ag, rs; one-directional ring)")
    ap.add_argument("--local", type=int, default=None, help="ranks per node (ar-hier, ar-hier-pipe, ar-hier-hd; default: one node)")
    a = ap.parse_args(argv)
    kw = {"bidirectional": True} if a.bidir else {}
    if a.chunks != 1:
        kw["chunks"] = a.chunks
    args = (a.local or a.world_size,) if a.op.startswith("ar-hier") else ()
    scheds = [BUILDERS[a.op](r, a.world_size, *args, **kw) for r in range(a.world_size)]
    validate(scheds)
    print(grid(scheds))
    print("validated: every send matched, no deadlock, every slice computed once, sums complete")


if __name__ == "__main__":
    main()
