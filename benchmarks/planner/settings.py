"""The settings of the committed benchmark tables, transcribed from their RESULTS.md commands (never their
timings): what the planner is asked to predict.

    OVERLAP   benchmarks/overlap: the MLP block (column AG+GEMM -> GELU -> row GEMM+RS), P = 2, b = 1, fp32,
              per-rank width w; one entry per run: (raw file, rate, seqs, hidden, width, methods compared)
              The hop_chunks runs took gloo's own reduce-scatter for stock and slicing (2x a ring's bytes,
              the earlier baseline): only their flash rows are compared.
    MOE       benchmarks/moe: one MoE layer, tokens 2048 per rank, hidden 512, expert ffn 1024, 8 experts,
              top-2, fp32, EP = 2 and 4 at 1gbit and 2gbit
    TOPOLOGY  benchmarks/topology: the all-reduce of 8 KB - 8 MB (bf16), 4 ranks (2 nodes x 2) and 8 ranks
              (4 x 2), htb 1gbit per node's egress, unshaped inside a node
    NOT_MODELLED  the tables whose setting the planner cannot reproduce on the proxy, and why
"""
from __future__ import annotations

FLASH_ONLY = ("flash", "flash c=2", "flash c=4")
ALL_TP = ("stock", "slicing k=2", "slicing k=4", "slicing k=8", "flash", "flash c=2")

OVERLAP = (
    ("overlap/data/point_raw.json", "2gbit", (2048,), 1024, 4096, ALL_TP),
    ("overlap/data/sweep_raw.json", "4gbit", (256, 512, 1024, 2048), 256, 512, ALL_TP),
    ("overlap/data/sweep_raw.json", "250mbit", (1024,), 256, 512, ALL_TP),
    ("overlap/data/sweep_raw.json", "1gbit", (1024,), 256, 512, ALL_TP),
    ("overlap/data/sweep_raw.json", "2gbit", (1024,), 256, 512, ALL_TP),
    ("overlap/data/hop_chunks_point_raw.json", "2gbit", (2048,), 1024, 4096, FLASH_ONLY),
    ("overlap/data/hop_chunks_sweep_raw.json", "4gbit", (256, 512, 1024, 2048), 256, 512, FLASH_ONLY),
    ("overlap/data/hop_chunks_sweep_raw.json", "250mbit", (1024,), 256, 512, FLASH_ONLY),
    ("overlap/data/hop_chunks_sweep_raw.json", "1gbit", (1024,), 256, 512, FLASH_ONLY),
    ("overlap/data/hop_chunks_sweep_raw.json", "2gbit", (1024,), 256, 512, FLASH_ONLY),
)
MODES = ("fwd", "fwd+bwd")
VARIANT = {"stock": "reference", "slicing k=2": "slicing:2", "slicing k=4": "slicing:4", "slicing k=8": "slicing:8",
           "flash": "flash:1", "flash c=2": "flash:2", "flash c=4": "flash:4"}

MOE = {"raw": "moe/data/ep_raw.json", "tokens": 2048, "hidden": 512, "ffn": 1024, "experts": 8, "topk": 2,
       "points": ((2, "1gbit"), (4, "1gbit"), (2, "2gbit"), (4, "2gbit")), "methods": ("stock", "flash")}
MOE_VARIANT = {"stock": "reference", "flash": "flash:1"}

TOPOLOGY = {"raw": "topology/data/two_level_raw.json", "rate": "1gbit", "layouts": ((4, 2), (8, 2)),
            "sizes": tuple(8192 * 2 ** i for i in range(11)),
            "methods": ("stock", "ring", "recursive_doubling", "hierarchical")}
TOPOLOGY_VARIANT = {"stock": "reference", "ring": "flash:ring", "recursive_doubling": "flash:recursive_doubling",
                    "hierarchical": "flash:hierarchical"}

RATES = ("250mbit", "1gbit", "2gbit", "4gbit")

NOT_MODELLED = {
    "pretrain": "a whole Megatron GPT step on CPU: the planner prices attention, norms, the embedding, the "
                "optimizer and Megatron's host work with GPU constants (layer_times.ATTN_EFF, NORM_PASSES, "
                "train_step.OPT_BYTES) that have no calibrated CPU counterpart here",
    "dp": "the same whole GPT step (its exposed DP time is a difference of two such steps), plus the DP worker "
          "thread placement ('worker' arm), which the model has no notion of",
    "attention": "query-split and Ulysses attention blocks: the attention core's CPU time (SDPA, causal) has no "
                 "calibrated table here",
    "host_overhead": "per-call host cost (Python calls), not a time the model prices",
    "gpu_check": "GPU-only runs",
}

# The one-window run (run.py --one-window, window.py): every window is one launch of ranks on one link; inside
# it the chooser's probe calibrates, then each point is measured and the probe calibrates again, `passes` times
# over the window's points. A point's settings are the committed tables' (the overlap sweep's MLP shape, the
# dp benchmark's TP-without-SP block, the MoE table's layer, the topology table's sizes x 2 off its own probe
# sizes), so the one-window scores speak of the same operators the tables do.
WINDOW_MLP = {"kind": "mlp", "seq": 1024, "hidden": 256, "width": 512, "methods": ALL_TP}
NOSP_METHODS = {"stock": ("reference", None), "slicing k=2": ("slicing", 2), "slicing k=4": ("slicing", 4),
                "flash C=2": ("flash", 2), "flash C=4": ("flash", 4)}  # benchmarks/dp's tp-nosp rows
NOSP_VARIANT = {"stock": "reference", "slicing k=2": "slicing:2", "slicing k=4": "slicing:4", "flash C=2": "flash:2",
                "flash C=4": "flash:4"}
WINDOW_NOSP = {"kind": "mlp_nosp", "seq": 1024, "hidden": 256, "width": 512, "methods": tuple(NOSP_METHODS)}
WINDOW_MOE = {"kind": "moe", **{k: MOE[k] for k in ("tokens", "hidden", "ffn", "experts", "topk")},
              "methods": MOE["methods"]}
WINDOW_AR = {"kind": "all_reduce", "local": 2, "dtype": "bfloat16", "sizes": (16384, 131072, 1 << 20, 8 << 20),
             "methods": TOPOLOGY["methods"]}
BURST = "80kb"  # the windows' tbf / htb bucket: the least above lo's 64 KiB packets (harness/netns.py shape_lo)
# hop and stock-collective sizes of a tbf window's probe: 4 KiB first, whose bytes take a small part of a call's
# fixed cost at these rates (0.07 ms at 1gbit), so proxy.link_fit's alpha is that cost; at 64 KiB the bytes alone
# take 1.0 ms at 1gbit, the whole exchange, and a fixed cost taken from it counts the bytes twice
TBF_PROBE = (4096, 65536, 262144, 1 << 20, 4 << 20)
HTB_PROBE = (8192, 65536, 524288, 4 << 20)  # the two-level window's: half the measured all-reduce sizes
WINDOWS = (  # (name, link: "tbf" | "htb", rate, ranks, points, probe sizes)
    ("tbf 1gbit", "tbf", "1gbit", 2, (WINDOW_MLP, WINDOW_NOSP, WINDOW_MOE), TBF_PROBE),
    ("tbf 4gbit", "tbf", "4gbit", 2, (WINDOW_MLP,), TBF_PROBE),
    ("htb 1gbit, 2 nodes x 2", "htb", "1gbit", 4, (WINDOW_AR,), HTB_PROBE),
)
WINDOW_NOT_MODELLED = {
    "pretrain": NOT_MODELLED["pretrain"],
}
