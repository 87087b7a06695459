"""The planner validated on the CPU proxy (issue 25 item 4a): calibrate the model to the machine, predict every
point of the committed benchmark tables from their settings alone, compare with what they measured.

    nice -n -10 python benchmarks/planner/run.py                      # all three steps, as root
    python benchmarks/planner/run.py --calibrate --rounds 5           # only: out/planner/calibration.json
    python benchmarks/planner/run.py --predict --calibration FILE     # only: predictions.json from FILE
    python benchmarks/planner/run.py --compare --predictions FILE     # only: comparison.md from FILE
    nice -n -10 python benchmarks/planner/run.py --one-window         # probe, points, probe, ... in one run
    python benchmarks/planner/run.py --one-window --compare --window FILE   # only: window.md from FILE

calibrate  benchmarks/planner/measure.py (what runs where) and calibrate.py (what each rank times: the GEMM
           table by shape, GELU, adds, our executor's hop and gloo's all-gather / all-reduce per size on
           each tbf rate, a GEMM beside a transfer; the one timing loop of runtime/timing.py)
predict    benchmarks/planner/predict.py: megatron_flashoverlap.plan priced with the calibration
           (plan/proxy.py: a measured GEMM table, ProxyNet's fitted link), the tables' settings from
           benchmarks/planner/settings.py; no measured block time is read
compare    benchmarks/planner/compare.py: per point and method predicted vs measured, median and max
           absolute error, and the predicted winner against the measured one where its interval excludes a tie
one window one_window.py / window.py: per window (settings.WINDOWS: a tbf or htb link) one launch of ranks that
           calibrates with the chooser's start-up probe (megatron/probe.py), measures a point, calibrates again,
           ...; window_predict.py prices each point from the calibration beside it, score.py scores, into
           window.json (every sample and calibration) and window.md (window_table.py)
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.harness.cli import out_dir, parser  # noqa: E402
from benchmarks.harness.netns import why_not_shaped  # noqa: E402
from benchmarks.planner import settings as S  # noqa: E402
from benchmarks.planner.table import render  # noqa: E402

NEEDS = ("It needs root and iproute2 (tbf and htb namespaces) and gcc (the topology's source-binding shim); "
         "--predict and --compare need neither.")


def _args(argv):
    p = parser(__doc__, "planner", NEEDS)
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--predict", action="store_true")
    p.add_argument("--compare", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rates", default=",".join(S.RATES))
    p.add_argument("--calibration", default=None, help="calibration JSON (default: --out's)")
    p.add_argument("--predictions", default=None, help="predictions JSON (default: --out's)")
    p.add_argument("--one-window", action="store_true", help="the one-window run (module docstring)")
    p.add_argument("--passes", type=int, default=2, help="one window: passes over each window's points")
    p.add_argument("--only", nargs="*", help="one window: the windows to run, by name (default: all)")
    p.add_argument("--window", default=None, help="one window: the raw JSON to render (default: --out's)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=out_dir("planner"))
    return p.parse_args(argv)


def _dump(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


def _one_window(a) -> int:
    path = a.window or os.path.join(a.out, "window.json")
    if not a.compare:
        reason = why_not_shaped()
        if reason:
            print(f"planner: {reason}", file=sys.stderr)
            return 2
        from benchmarks.planner.one_window import one_window
        _dump(path, one_window(a.rounds, a.passes, a.timeout, only=a.only))
    from benchmarks.planner.window_table import render as render_window
    with open(path) as f:
        text = render_window(json.load(f), os.path.basename(path))
    md = os.path.splitext(path)[0] + ".md" if a.window else os.path.join(a.out, "window.md")
    os.makedirs(os.path.dirname(md), exist_ok=True)
    with open(md, "w") as f:
        f.write(text)
    print(text)
    return 0


def main(argv=None) -> int:
    a = _args(argv)
    if a.one_window:
        return _one_window(a)
    steps = [s for s in ("calibrate", "predict", "compare") if getattr(a, s)] or ["calibrate", "predict", "compare"]
    cal_path = a.calibration or os.path.join(a.out, "calibration.json")
    pred_path = a.predictions or os.path.join(a.out, "predictions.json")
    if "calibrate" in steps:
        reason = why_not_shaped()
        if reason:
            print(f"planner: {reason}", file=sys.stderr)
            return 2
        from benchmarks.planner.measure import calibrate
        _dump(cal_path, calibrate(a.rounds, tuple(a.rates.split(",")), a.timeout))
    if "predict" in steps:
        from benchmarks.planner.predict import predict_all
        with open(cal_path) as f:
            cal = json.load(f)
        _dump(pred_path, {stat: predict_all(cal, stat) for stat in ("lo", "median")})
    if "compare" in steps:
        from benchmarks.planner.compare import measured
        with open(pred_path) as f:
            preds = {stat: {k: v for section in p.values() for k, v in section.items()}
                     for stat, p in json.load(f).items()}
        named = {{"lo": "minimum"}.get(s, s): p for s, p in preds.items()}
        cal = None
        if os.path.exists(cal_path):
            with open(cal_path) as f:
                cal = json.load(f)
        text = render(named, measured(os.path.join(ROOT, "benchmarks")), cal, os.path.basename(cal_path))
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "comparison.md"), "w") as f:
            f.write(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
