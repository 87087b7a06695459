"""The README's main job: train a tiny real Megatron-Core GPTModel, TP=2 + sequence parallel, on 2 CPU ranks.

Two arms train side by side from the SAME initial weights on the SAME generated batches:

    local   Megatron-Core's stock local spec: blocking all-gather / reduce-scatter around each TP GEMM
    flash   megatron_flashoverlap.spec.flashoverlap_layer_spec + configs/flash.yaml: every collective
            decomposed into P2P ring steps with rank-adaptive GEMM slices in between

The task is learnable: each sequence counts up from a random token with a random stride k in {1, 2, 3}
(mod vocab), so after two tokens the rest is predictable and the loss falls from ~ln(vocab) toward 0.
Prints both loss curves per step, time per step of each arm, the max loss difference, and writes a PNG.

    python examples/train_tiny_gpt.py [--steps 40] [--config configs/flash.yaml] [--plot PATH] [--json PATH]

Runs on CPU over gloo (megatron_flashoverlap.megatron.cpu.enable()); 2 spawned ranks, about a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "examples.train_tiny_gpt:train"  # what each rank runs (imported from ROOT by the pool)
ARMS = ("local", "flash")


# ----------------------------------------------------------------------------------------- per rank
def make_batch(step: int, b: int, s: int, vocab: int, seed: int = 0) -> dict:
    """tokens / position_ids / labels [b, s], identical on every rank: token_t = start + k*t (mod vocab)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, vocab, (b, 1), generator=g)
    stride = torch.randint(1, 4, (b, 1), generator=g)
    tokens = (start + stride * torch.arange(s + 1)) % vocab  # [b, s+1]
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    return {"input_ids": tokens[:, :-1].contiguous(), "position_ids": pos.contiguous(),
            "labels": tokens[:, 1:].contiguous()}


def _specs(config, config_path: str) -> dict:
    """local: Megatron's stock local spec; flash: our `--spec` entry point, called as Megatron calls it,
    with the per-layer YAML activated in-process (what the --flash-overlap flag does at parse time)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_flashoverlap.config import activate, load_config
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    activate(load_config(config_path))
    return {"local": get_gpt_layer_local_spec(), "flash": flashoverlap_layer_spec(config)}


def _step(model, opt, decay, data) -> tuple:
    """One optimizer step; (mean token loss, seconds)."""
    from megatron_flashoverlap.megatron.models import allreduce_sequence_parallel_grads, gpt_loss

    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = gpt_loss(model, data)
    loss.backward()
    allreduce_sequence_parallel_grads(model)  # finalize_model_grads' SP part (no DDP wrapper here)
    opt.step()
    decay.step()
    return loss.item(), time.perf_counter() - t0


def _build(opts: dict) -> dict:
    """Both models, the flash one loaded with the local one's weights; returns {arm: (model, optimizer)}."""
    import torch

    from megatron_flashoverlap.megatron.models import build_gpt, copy_weights, tiny_config

    config = tiny_config(opts["tp"], sp=True, num_layers=opts["layers"], hidden=opts["hidden"],
                         heads=opts["heads"], ffn=4 * opts["hidden"])
    specs = _specs(config, opts["config"])
    models = {arm: build_gpt(config, specs[arm], seed=opts["seed"], vocab=opts["vocab"], seq=opts["seq"])
              for arm in ARMS}
    copy_weights(models["flash"], models["local"])
    return {arm: _optimizer(m, opts) for arm, m in models.items()}


def _optimizer(model, opts: dict) -> tuple:
    """(model, Adam, linear decay of the learning rate to 10 % over the run)."""
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=opts["lr"])
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * i / opts["steps"])
    return model, opt, decay


def _same_weights(a, b) -> bool:
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))


def sites(model) -> dict:
    """{site: what its linears ran}, e.g. {"qkv": "flash", ...} or "stock (no sequence parallel)"."""
    ran: dict = {}
    for module in model.modules():
        plan = getattr(module, "flash_plan", None)
        if plan is not None:
            why = module._stock_reason()
            ran.setdefault(module.flash_site, set()).add(plan.algo if why is None else f"stock ({why})")
    return {site: "/".join(sorted(algos)) for site, algos in sorted(ran.items())}


def _quiet() -> None:
    """Megatron-Core on CPU warns at import and build time (no apex / TE / CUDA runtime, GPTModel deprecated
    in favour of HybridModel); the demo's output is the curves. --verbose keeps them."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("megatron", "torch.utils.cpp_extension"):
        logging.getLogger(name).setLevel(logging.ERROR)


def train(rank: int, world: int, opts: dict) -> dict:
    """Rank body: both arms, interleaved step by step (same batch), so machine noise hits both alike."""
    if not opts["verbose"]:
        _quiet()
    from megatron_flashoverlap.megatron.models import destroy, init_tp

    init_tp(opts["tp"], seed=opts["seed"])
    try:
        arms = _build(opts)
        out = {"init_equal": _same_weights(arms["local"][0], arms["flash"][0]),
               "sites": sites(arms["flash"][0])}
        out.update({f"loss_{a}": [] for a in ARMS}, **{f"time_{a}": [] for a in ARMS})
        for step in range(opts["steps"]):
            data = make_batch(step, opts["batch"], opts["seq"], opts["vocab"], opts["seed"])
            for arm, (model, opt, decay) in arms.items():
                loss, dt = _step(model, opt, decay, data)
                out[f"loss_{arm}"].append(loss)
                out[f"time_{arm}"].append(dt)
            if rank == 0:
                _progress(step, opts["steps"], out)
        return out
    finally:
        destroy()


def _progress(step: int, steps: int, out: dict) -> None:
    """One line redrawn in place on a terminal; every 10th step otherwise (logs, CI)."""
    tty, last = sys.stdout.isatty(), step + 1 == steps
    if not (tty or last or (step + 1) % 10 == 0):
        return
    print(f"  step {step + 1:3d}/{steps}  loss local {out['loss_local'][-1]:.4f}  "
          f"flash {out['loss_flash'][-1]:.4f}", end="\r" if tty and not last else "\n", flush=True)


# ------------------------------------------------------------------------------------------ parent
def report(out: dict, ranks: int) -> str:
    """The side-by-side table and the summary lines."""
    rows = [f"{'step':>4}  {'loss local':>10}  {'loss flash':>10}  {'|diff|':>8}  {'ms local':>8}  {'ms flash':>8}"]
    for i, (a, b) in enumerate(zip(out["loss_local"], out["loss_flash"])):
        rows.append(f"{i + 1:4d}  {a:10.5f}  {b:10.5f}  {abs(a - b):8.1e}  "
                    f"{1e3 * out['time_local'][i]:8.1f}  {1e3 * out['time_flash'][i]:8.1f}")
    ms = {a: 1e3 * statistics.median(out[f"time_{a}"]) for a in ARMS}
    rows += ["",
             f"same initial weights: {out['init_equal']}",
             "flash arm, per GEMM site: " + ", ".join(f"{k}={v}" for k, v in out["sites"].items()),
             f"loss local {out['loss_local'][0]:.4f} -> {out['loss_local'][-1]:.4f}   "
             f"flash {out['loss_flash'][0]:.4f} -> {out['loss_flash'][-1]:.4f}",
             f"max |loss local - loss flash| over {len(out['loss_local'])} steps: {max_diff(out):.2e}",
             f"median time per step: local {ms['local']:.1f} ms, flash {ms['flash']:.1f} ms "
             f"({ranks} ranks on a shared CPU over loopback gloo: timings are noisy, not a speed claim)"]
    return "\n".join(rows)


def max_diff(out: dict) -> float:
    return max(abs(a - b) for a, b in zip(out["loss_local"], out["loss_flash"]))


def plot(out: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(out["loss_local"]) + 1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, out["loss_local"], "o-", label="local spec (stock Megatron)", ms=4)
    ax1.plot(steps, out["loss_flash"], "x--", label="flashoverlap spec", ms=5)
    ax1.set(xlabel="step", ylabel="mean token loss", title="loss (same init, same batches)")
    ax1.legend()
    for arm, marker in zip(ARMS, "ox"):
        ax2.plot(steps, [1e3 * t for t in out[f"time_{arm}"]], marker + "-", label=arm, ms=4)
    ax2.set(xlabel="step", ylabel="ms / step", title="time per step (noisy shared CPU)")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "flash.yaml"))
    p.add_argument("--plot", default=os.path.join("results", "train_tiny_gpt.png"))
    p.add_argument("--json", default=None, help="also write the curves as JSON here")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--verbose", action="store_true", help="keep Megatron's import/build warnings")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed")
    return p.parse_args(argv)


def main(argv=None, pool=None) -> dict:
    """Spawns its own 2 gloo ranks unless given a running `Pool` of that size (the tests pass theirs)."""
    args = parse(argv)
    opts = {k: v for k, v in vars(args).items() if k not in ("plot", "json", "timeout")}
    from megatron_flashoverlap.testing import Pool

    print(f"tiny GPT: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"vocab {args.vocab}; TP={args.tp} + sequence parallel on {args.tp} CPU ranks (gloo); "
          f"local spec vs flashoverlap ({os.path.relpath(args.config)}), {args.steps} steps", flush=True)
    t0 = time.perf_counter()
    own = pool is None
    pool = Pool(args.tp, env={"PYTHONPATH": ROOT}) if own else pool
    try:
        out = pool.run(TARGET, opts, timeout=args.timeout)[0]
    finally:
        if own:
            pool.close()
    print(report(out, args.tp))
    plot(out, args.plot, f"tiny GPTModel, TP={args.tp} + SP, {args.tp} CPU ranks")
    print(f"plot: {args.plot}   (total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "max_diff": max_diff(out), "opts": opts}, f)
    return out


if __name__ == "__main__":
    main()
