"""Serving on an emulated two-level topology: Megatron's OpenAI-compatible server (the project's entry,
`python -m megatron_flashoverlap.serve`) under an open-loop Poisson load, stock vs --flash-overlap, TP = 4 as
2 nodes x 2 ranks; the offline generate entry's throughput beside it.

    sudo .venv/bin/python benchmarks/serving/run.py --rates 0.25 0.5 1 2 --requests 24 --rounds 2
    sudo .venv/bin/python benchmarks/serving/run.py --quick                    # smoke: tiny model, 2 rates, 4 requests
    .venv/bin/python benchmarks/serving/run.py --render benchmarks/serving/data/serving_raw.json   # tables again

Steps: (1) one pretrain() iteration saves the served weights (`python -m megatron_flashoverlap.pretrain_gpt
--cpu --nproc-per-node 4`, host loopback, not timed; --ckpt reuses a folder). (2) In one network namespace,
nodes are loopback addresses with htb between them (benchmarks/harness/topology.py: --inter-rate per node's
egress, intra-node unshaped), every rank bound to its node's address. (3) Per round, per arm (order rotated
per round): the server's ranks start through the harness launcher (benchmarks/serving/rank.py: the engine's
per-request times kept on rank 0), the client (benchmarks/serving/client.py, stdlib HTTP, inside the namespace)
waits for /health, sends one warm-up request, then drives every rate of the plan (benchmarks/serving/load.py:
the same requests at the same times for every arm and round); then the server is stopped (SIGTERM, its orderly
shutdown) and the offline entry (MegatronLLM, every prompt of the first rate at once) runs once on the same
topology. Figures (benchmarks/serving/table.py): TTFT, TPOT, end-to-end latency and tokens/s per rate and arm,
medians with bootstrap intervals and stock/flash ratios by benchmarks/harness/estimator.py, and how many
requests got the same greedy tokens in both arms. Writes --out (.md), its _raw.json and .png beside it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # run as a script: the checkout's root on the path, not this folder
    sys.path[0] = ROOT

from benchmarks.harness.cli import out_dir, parser, rerender  # noqa: E402
from benchmarks.harness.launch import command_line, run_ranks, write_text  # noqa: E402
from benchmarks.harness.netns import shaped_namespace, why_not_shaped  # noqa: E402
from benchmarks.harness.topology import add_nodes, build_shim, class_bytes, rank_env, shape_inter_node  # noqa: E402
from benchmarks.serving.load import ARMS, generate_argv, plan, serve_argv, train_argv  # noqa: E402
from benchmarks.serving.table import markdown, plot  # noqa: E402

RANK, CLIENT, PORT = "benchmarks.serving.rank", "benchmarks.serving.client", 8000
NEEDS = ("It needs root, iproute2 and gcc (a network namespace, htb on its loopback and an LD_PRELOAD shim built "
         "from benchmarks/harness/bind_source.c); there is no unshaped mode. The server needs the `serve` extra.")
QUICK = {"layers": 2, "hidden": 64, "heads": 4, "seq": 64, "rates": [1.0, 4.0], "requests": 4, "prompt": [4, 24],
         "output": [4, 12], "rounds": 1}


def parse(argv=None):
    p = parser(__doc__, "serving", NEEDS)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2, help="ranks per node (TP = nodes x local)")
    p.add_argument("--inter-rate", default="1gbit", help="htb rate of each node's inter-node egress")
    p.add_argument("--burst", default="256kb")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="offered requests/s")
    p.add_argument("--requests", type=int, default=24, help="requests per rate")
    p.add_argument("--prompt", type=int, nargs=2, default=[16, 192], metavar=("MIN", "MAX"), help="prompt tokens")
    p.add_argument("--output", type=int, nargs=2, default=[8, 48], metavar=("MIN", "MAX"), help="output tokens")
    p.add_argument("--rounds", type=int, default=2, help="every arm serves the whole plan once per round")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list among {list(ARMS)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=256, help="the model's positions (prompt + output must fit)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--kv-gb", type=float, default=0.5, help="the dynamic engine's KV buffer per rank (GB)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline generate runs")
    p.add_argument("--ckpt", default=None, help="a checkpoint folder to reuse (made there when empty)")
    p.add_argument("--quick", action="store_true", help="smoke: " + json.dumps(QUICK))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per server or offline run")
    p.add_argument("--out", default=os.path.join(out_dir("serving"), "serving.md"),
                   help="the markdown (X.md; X_raw.json and X.png beside it; default out/serving/serving.md)")
    p.add_argument("--render", metavar="RAW", help="rewrite the tables of the markdown beside RAW from its samples")
    a = p.parse_args(argv)
    if a.quick:
        vars(a).update(QUICK)
    return a


def config(a) -> dict:
    return {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq, "vocab": a.vocab,
            "tp": a.nodes * a.local, "kv_gb": a.kv_gb, "rates": a.rates, "requests": a.requests,
            "prompt": a.prompt, "output": a.output}


def checkpoint(a, cfg: dict, tmp: str) -> str:
    """The served weights: --ckpt when it holds a checkpoint, else one pretrain() iteration saves them."""
    ckpt = os.path.abspath(a.ckpt or os.path.join(tmp, "ckpt"))
    if os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
        return ckpt
    cmd = [sys.executable, "-m", "megatron_flashoverlap.pretrain_gpt", "--nproc-per-node", str(cfg["tp"]),
           *train_argv(cfg, ckpt)]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"saving the checkpoint failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return ckpt


def ranks(ns, shim: str, a, target: list[str]):
    """Rank 0's result of `target` on the topology (every rank bound to its node's address)."""
    return run_ranks(target, a.nodes * a.local, ns=ns, env={"LD_PRELOAD": shim}, rank_env=rank_env(a.local),
                     timeout=a.timeout)[0]


def serve_round(ns, shim: str, a, arm: str, paths: dict) -> dict:
    """One server of `arm` under the whole plan -> {"client": {rate: answers}, "engine": [records]}."""
    stop, answers, got = paths["tmp"] + f"/stop-{arm}", paths["tmp"] + f"/client-{arm}.json", {}
    for stale in (stop, answers):
        if os.path.exists(stale):
            os.remove(stale)

    def server() -> None:
        try:
            got["engine"] = ranks(ns, shim, a, [RANK, "serve", stop, *serve_argv(arm, paths["cfg"], paths["ckpt"],
                                                                                PORT)])
        except BaseException as err:  # reported below, after the client
            got["error"] = err
    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    try:
        client = ns.run([sys.executable, "-m", CLIENT, paths["plan"], f"http://127.0.0.1:{PORT}", answers,
                         "--ready-s", str(a.timeout)], env={**os.environ, "PYTHONPATH": ROOT}, timeout=a.timeout)
    finally:
        open(stop, "w").close()
        thread.join(a.timeout)
    if "error" in got or client.returncode != 0 or "engine" not in got:
        raise SystemExit(f"{arm}: the server or the client failed (client exit {client.returncode}): "
                         f"{got.get('error', 'no records')}")
    with open(answers) as f:
        return {"client": json.load(f), "engine": got["engine"]}


def measure(a, cfg: dict, ckpt: str, load: dict, tmp: str) -> dict:
    """Every round: each arm's server (order rotated per round), then each arm's offline run."""
    arms = [x for x in a.arms.split(",") if x]
    runs, offline = {arm: [] for arm in arms}, {arm: [] for arm in arms}
    paths = {"tmp": tmp, "cfg": cfg, "ckpt": ckpt, "plan": os.path.join(tmp, "plan.json")}
    with open(paths["plan"], "w") as f:
        json.dump(load, f)
    with shaped_namespace(None) as ns:
        shim = build_shim(tmp)
        add_nodes(ns, a.nodes)
        shape_inter_node(ns, a.nodes, a.inter_rate, a.burst)
        for r in range(a.rounds):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                runs[arm].append(serve_round(ns, shim, a, arm, paths))
                print(f"  round {r} {arm}: served {sum(map(len, runs[arm][-1]['client'].values()))} requests",
                      flush=True)
                if not a.no_offline:
                    target = [RANK, "generate", "-", *generate_argv(arm, cfg, ckpt, next(iter(load["rates"].values())))]
                    offline[arm].append(ranks(ns, shim, a, target))
        htb = class_bytes(ns)
    return {"runs": runs, "offline": offline if not a.no_offline else {}, "htb_bytes": htb}


def body(raw: dict) -> str:
    return markdown(raw) + "\nbytes per htb class (1:<node+1> = shaped inter-node egress) and direct (unshaped) " \
                           f"packets: {json.dumps(raw['htb_bytes'])}\n"


def report(a, cfg: dict, argv) -> str:
    head = (f"GPT {a.layers} layers, hidden {a.hidden}, {a.heads} heads, {a.seq} positions, vocab {a.vocab}, fp32, "
            f"TP = {cfg['tp']} as {a.nodes} nodes x {a.local} ranks (gloo, CPU), inter-node htb {a.inter_rate} per "
            f"node, intra-node unshaped loopback; {a.requests} requests per rate, Poisson arrivals, prompts "
            f"{a.prompt[0]}-{a.prompt[1]} tokens, outputs {a.output[0]}-{a.output[1]} tokens (greedy), "
            f"{a.rounds} round(s) per arm, KV buffer {a.kv_gb} GB per rank")
    return "\n".join(["# Serving on a two-level topology: stock vs --flash-overlap", "",
                      f"Command: `{command_line('serving/run.py', argv)}`", "", head, ""]) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    if a.render:
        rerender(a.render, body, "serving/run.py")
        return 0
    if why_not_shaped():
        raise SystemExit(f"serving benchmark: {why_not_shaped()}")
    cfg = config(a)
    load = plan(cfg)  # a plan that cannot fit the model fails here, before any run
    with tempfile.TemporaryDirectory(prefix="serving-") as tmp:
        raw = {"config": {**cfg, "inter_rate": a.inter_rate, "burst": a.burst, "rounds": a.rounds}, "plan": load,
               **measure(a, cfg, checkpoint(a, cfg, tmp), load, tmp)}
    base = os.path.splitext(a.out)[0]
    write_text(a.out, report(a, cfg, argv) + body(raw))
    with open(base + "_raw.json", "w") as f:
        json.dump(raw, f)
    plot(raw, base + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
