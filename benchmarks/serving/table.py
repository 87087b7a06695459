"""benchmarks/serving/run.py's figures, tables and plot from its raw JSON.

    raw = {"config", "plan" (load.plan), "runs": {arm: [{"client": {rate: [answer]}, "engine": [record]}]},
           "offline": {arm: [{"seconds", "tokens", "requests"}]}}       one list entry per round
    requests(plan, run, rate) -> [{"ttft", "tpot", "e2e", "tokens"} or None]   one per planned request
        ttft = engine's first-token time - client's send time   (queueing, HTTP and prefill: what a user waits)
        tpot = (engine's finish time - first-token time) / (tokens - 1)
        e2e  = client's answer time - send time
    summarize(raw) -> {rate: {"ttft"|"tpot"|"e2e": {arm: {"median", "ci"}}, "tps": {arm: median},
                              "vs": {"ttft"|"tpot": speedup}, "same": (identical, compared)}}
    markdown(raw) -> the sections;   plot(raw, path) -> latency against offered load

Medians pool every round's requests of a rate; intervals are benchmarks/harness/estimator.py's bootstrap (90 %);
stock vs flash is its speedup (median ratio, pairs = the same planned request in the same round: both arms get
the same prompts at the same times), a win or loss only where the interval excludes 1.0. tokens/s of a rate:
its generated tokens / (last answer - first send), median over rounds. "same tokens": requests whose greedy
tokens are identical in both arms (same round), out of those both arms answered.
"""
from __future__ import annotations

import statistics

from benchmarks.harness.estimator import LEVEL, bootstrap, speedup
from benchmarks.harness.verdict import word

METRICS = ("ttft", "tpot", "e2e")


def _one(answer: dict, record: dict | None) -> dict | None:
    if answer.get("error") or record is None or record["first"] is None:
        return None
    n = len(record["tokens"])
    tpot = (record["finish"] - record["first"]) / (n - 1) if n > 1 and record["finish"] else None
    return {"ttft": record["first"] - answer["sent"], "tpot": tpot, "e2e": answer["done"] - answer["sent"],
            "tokens": answer["tokens"]}


def requests(plan: dict, run: dict, rate: str) -> list:
    """Per planned request of `rate` (plan order): its figures, None where it failed or was not recorded."""
    by_prompt = {tuple(r["prompt"]): r for r in run["engine"]}
    answers = {a["id"]: a for a in run["client"][rate]}
    return [_one(answers[q["id"]], by_prompt.get(tuple(q["prompt"]))) if q["id"] in answers else None
            for q in plan["rates"][rate]]


def _tps(run: dict, rate: str) -> float:
    ok = [a for a in run["client"][rate] if not a.get("error")]
    span = max(a["done"] for a in ok) - min(a["sent"] for a in ok)
    return sum(len(a["tokens"]) for a in ok) / span


def _pairs(per_arm: dict, metric: str) -> tuple[list, list]:
    """Stock's and flash's values of the requests both answered (same round, same request)."""
    s, f = [], []
    for a, b in zip(per_arm["stock"], per_arm["flash"]):
        if a and b and a[metric] is not None and b[metric] is not None:
            s.append(a[metric])
            f.append(b[metric])
    return s, f


def _stat(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": float("nan"), "ci": (float("nan"), float("nan"))}
    return {"median": statistics.median(values), "ci": bootstrap(statistics.median, values)}


def _rate(raw: dict, rate: str) -> dict:
    per_arm = {arm: [r for run in runs for r in requests(raw["plan"], run, rate)] for arm, runs in raw["runs"].items()}
    out = {m: {arm: _stat([r[m] for r in rs if r]) for arm, rs in per_arm.items()} for m in METRICS}
    out["tps"] = {arm: statistics.median(_tps(run, rate) for run in runs) for arm, runs in raw["runs"].items()}
    if {"stock", "flash"} <= set(per_arm):
        out["vs"] = {m: speedup(*_pairs(per_arm, m)) for m in ("ttft", "tpot") if _pairs(per_arm, m)[0]}
        both = [(a, b) for a, b in zip(per_arm["stock"], per_arm["flash"]) if a and b]
        out["same"] = (sum(a["tokens"] == b["tokens"] for a, b in both), len(both))
    return out


def summarize(raw: dict) -> dict:
    return {rate: _rate(raw, rate) for rate in raw["plan"]["rates"]}


def _ms(s: dict) -> str:
    return f"{s['median'] * 1e3:.0f} [{s['ci'][0] * 1e3:.0f}, {s['ci'][1] * 1e3:.0f}]"


def _vs(v: dict | None) -> str:
    return "-" if v is None else f"{v['ratio']:.2f}x [{v['ci'][0]:.2f}, {v['ci'][1]:.2f}] {word(v)}"


def latency_table(s: dict, arms: list) -> str:
    head = ["| offered rate (req/s) | arm | TTFT ms | TPOT ms | end-to-end ms | tokens/s |", "|---|---|---|---|---|---|"]
    rows = [f"| {rate} | {arm} | {_ms(r['ttft'][arm])} | {_ms(r['tpot'][arm])} | {_ms(r['e2e'][arm])} | "
            f"{r['tps'][arm]:.1f} |" for rate, r in s.items() for arm in arms]
    return "\n".join(head + rows)


def compare_table(s: dict) -> str:
    head = ["| offered rate (req/s) | TTFT stock / flash | TPOT stock / flash | same tokens |", "|---|---|---|---|"]
    rows = [f"| {rate} | {_vs(r['vs'].get('ttft'))} | {_vs(r['vs'].get('tpot'))} | {r['same'][0]}/{r['same'][1]} |"
            for rate, r in s.items() if "vs" in r]
    return "\n".join(head + rows)


def offline_table(raw: dict) -> str:
    off = raw.get("offline") or {}
    rows = ["| arm | tokens/s (median of rounds) | seconds | requests identical to stock |", "|---|---|---|---|"]
    for arm, runs in off.items():
        tps = statistics.median(r["tokens"] / r["seconds"] for r in runs)
        same = sum(a == b for r, st in zip(runs, off.get("stock", runs)) for a, b in zip(r["requests"], st["requests"]))
        rows.append(f"| {arm} | {tps:.1f} | {statistics.median(r['seconds'] for r in runs):.1f} | "
                    f"{same}/{sum(len(r['requests']) for r in runs)} |")
    return "\n".join(rows)


def markdown(raw: dict) -> str:
    s, arms = summarize(raw), list(raw["runs"])
    level = f"{LEVEL:.0%}"
    return "\n".join([
        f"## Latency and throughput per offered load (medians [{level} bootstrap interval] over requests)", "",
        latency_table(s, arms), "", f"## Stock vs --flash-overlap (median ratio [{level} interval], same requests)",
        "", compare_table(s), "", "## Offline generate (MegatronLLM, every prompt at once, the longest output length)",
        "", offline_table(raw), ""])


def plot(raw: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize(raw)
    rates = [float(r) for r in s]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, title in zip(axes, ("ttft", "tpot"), ("time to first token", "time per output token")):
        for arm in raw["runs"]:
            med = [s[r][metric][arm]["median"] * 1e3 for r in s]
            err = [[m - s[r][metric][arm]["ci"][0] * 1e3 for m, r in zip(med, s)],
                   [s[r][metric][arm]["ci"][1] * 1e3 - m for m, r in zip(med, s)]]
            ax.errorbar(rates, med, yerr=err, marker="o", capsize=3, label=arm)
        ax.set(xlabel="offered load (requests/s, Poisson)", ylabel="ms (median, 90 % interval)", title=title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
