"""A picture of one layer's TP sites, forward + backward, stock above and the plan below (matplotlib, optional).

Four lanes: stock compute, stock communication, ours compute, ours communication; the sites one after another
(qkv, proj, fc1, fc2, then Ulysses / MoE where present), each from the same priced walk that gave its time.
Attention and elementwise work sit between them in a real layer and are left out of the picture.
"""
from __future__ import annotations

from pathlib import Path

from .train_step import StepTimes


def _events(st: StepTimes, stock: bool) -> list:
    out, shift = [], 0.0
    for site in list(st.layer.sites.values()) + list(st.layer.extras.values()):
        clock = site.op.replay["reference" if stock else site.variant]()
        out += [(lane, a + shift, b + shift, f"{site.name}: {txt}") for lane, a, b, txt in clock.events]
        out.append(("site", shift, shift + clock.t, site.name))
        shift += clock.t
    return out


def draw(st: StepTimes, path: str | Path) -> None:
    """Write the picture to `path` (its suffix picks the format)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--timeline needs matplotlib: pip install matplotlib (or the 'bench' extra: "
                         "pip install 'megatron-flashoverlap[bench]')") from None
    lanes = {("stock", "compute"): 3, ("stock", "comm"): 2, ("ours", "compute"): 1, ("ours", "comm"): 0}
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    fig, ax = plt.subplots(figsize=(14, 3.5))
    for who in ("stock", "ours"):
        for lane, a, b, txt in _events(st, who == "stock"):
            if lane == "site":  # a separator and the site's name over its own two lanes
                low = 2.0 if who == "stock" else 0.0
                ax.vlines(a * 1e3, low, low + 2.0, color="grey", lw=0.5)
                ax.text(a * 1e3, low + 1.92, " " + txt, fontsize=7, va="top")
                continue
            ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (lanes[(who, lane)] + 0.1, 0.8), facecolors=colors[lane],
                           edgecolors="white", linewidth=0.3)
    ax.set_yticks([0.5, 1.5, 2.5, 3.5], ["ours comm", "ours compute", "stock comm", "stock compute"])
    ax.set_xlabel("ms (one layer's TP sites, forward + backward; PREDICTION)")
    ax.set_title(f"flashoverlap-plan: TP={st.layout.tp} {st.model.hidden}h s={st.model.seq}: stock vs plan")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
