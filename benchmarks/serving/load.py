"""benchmarks/serving/run.py's settings as data: the model's Megatron arguments, the arms, and the request load.

    model_argv(cfg) -> [megatron args]       the GPT of every run: TP = cfg["tp"], NullTokenizer, seed 1234
    train_argv(cfg, ckpt) -> entry argv      one pretrain() iteration saving `ckpt` (the served weights)
    serve_argv(arm, cfg, ckpt, port) -> entry argv        `python -m megatron_flashoverlap.serve` per rank
    generate_argv(arm, cfg, ckpt, requests) -> entry argv  `python -m megatron_flashoverlap.generate` per rank
    plan(cfg) -> {"rates": {rate: [request]}, "warmup": request}
        request = {"id", "at" (seconds after the rate's start), "prompt" (token ids), "max_tokens"}

The load: for each offered rate (requests/s), cfg["requests"] requests with exponential gaps (open-loop Poisson
arrivals: a request is sent at its time whatever the earlier ones are doing), prompt lengths uniform in
cfg["prompt"] = (min, max) tokens, output lengths uniform in cfg["output"]; the prompts are random token ids, all
distinct (a request is found again by its prompt in the engine's records), one seed for the whole plan, so every
arm and every round gets the same requests at the same times.
"""
from __future__ import annotations

import random

ARMS = {"stock": [], "flash": ["--flash-overlap"]}
SEED = 1234


def model_argv(cfg: dict) -> list[str]:
    """Megatron's model arguments: cfg {"layers", "hidden", "heads", "seq", "vocab", "tp"}."""
    c = {k: str(v) for k, v in cfg.items()}
    return ["--num-layers", c["layers"], "--hidden-size", c["hidden"], "--num-attention-heads", c["heads"],
            "--seq-length", c["seq"], "--max-position-embeddings", c["seq"], "--tensor-model-parallel-size",
            c["tp"], "--tokenizer-type", "NullTokenizer", "--vocab-size", c["vocab"], "--seed", str(SEED)]


def train_argv(cfg: dict, ckpt: str) -> list[str]:
    """`python -m megatron_flashoverlap.pretrain_gpt` (one rank's argv): one iteration on mock data, saved."""
    return ["--cpu", *model_argv(cfg), "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
            "--train-iters", "1", "--eval-iters", "0", "--eval-interval", "1000000", "--mock-data",
            "--save", ckpt, "--save-interval", "1"]


def _arm(arm: str) -> list[str]:
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose among {sorted(ARMS)}")
    return ARMS[arm]


def _inference(cfg: dict, ckpt: str) -> list[str]:
    return ["--micro-batch-size", "1", "--load", ckpt, "--inference-dynamic-batching-buffer-size-gb",
            str(cfg["kv_gb"])]


def serve_argv(arm: str, cfg: dict, ckpt: str, port: int) -> list[str]:
    """The server's per-rank argv (no --nproc-per-node: harness.launch starts the ranks)."""
    return ["--cpu", *model_argv(cfg), *_inference(cfg, ckpt), "--host", "127.0.0.1", "--port", str(port),
            "--frontend-replicas", "1", *_arm(arm)]


def generate_argv(arm: str, cfg: dict, ckpt: str, requests: list[dict]) -> list[str]:
    """The offline entry's per-rank argv: every prompt of `requests` at once, the longest output length."""
    tokens = max(r["max_tokens"] for r in requests)
    return ["--cpu", *model_argv(cfg), *_inference(cfg, ckpt), "--num-tokens-to-generate", str(tokens),
            "--prompts", *(" ".join(map(str, r["prompt"])) for r in requests), *_arm(arm)]


def _prompt(rng: random.Random, cfg: dict, seen: set) -> list[int]:
    while True:
        p = tuple(rng.randint(1, cfg["vocab"] - 2) for _ in range(rng.randint(*cfg["prompt"])))
        if p not in seen:
            seen.add(p)
            return list(p)


def plan(cfg: dict) -> dict:
    """Every rate's requests (module docstring) and one warm-up request (sent first, not measured)."""
    if cfg["prompt"][1] + cfg["output"][1] > cfg["seq"]:
        raise ValueError(f"prompt max {cfg['prompt'][1]} + output max {cfg['output'][1]} exceeds --seq "
                         f"{cfg['seq']} (the model's positions): lower them or raise --seq")
    rng, seen, rates, n = random.Random(SEED), set(), {}, 0
    for rate in cfg["rates"]:
        at, reqs = 0.0, []
        for _ in range(cfg["requests"]):
            reqs.append({"id": n, "at": at, "prompt": _prompt(rng, cfg, seen),
                         "max_tokens": rng.randint(*cfg["output"])})
            at, n = at + rng.expovariate(rate), n + 1
        rates[str(rate)] = reqs
    warmup = {"id": -1, "at": 0.0, "prompt": _prompt(rng, cfg, seen), "max_tokens": cfg["output"][0]}
    return {"rates": rates, "warmup": warmup}
