"""The HTTP client of benchmarks/serving/run.py (stdlib only), run inside the topology's namespace:

    python -m benchmarks.serving.client PLAN URL OUT [--ready-s 900] [--request-s 600]

Waits for the server's GET /health, sends PLAN's warm-up request, then for each rate of PLAN (load.plan) drives
its requests open loop: request i is POSTed to URL/v1/completions at start + at_i from its own thread, whatever
the earlier ones are doing (greedy: temperature 0; ignore_eos: every answer has max_tokens tokens). A rate ends
when all its answers are in; the next starts after that. OUT (JSON): {rate: [{"id", "sent", "done", "tokens",
"error"}]} with `sent` and `done` on the host's wall clock (time.time(), the clock the engine stamps its events
with: the namespace shares it).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait_ready(url: str, ready_s: float) -> None:
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise SystemExit(f"client: {url}/health did not answer within {ready_s:.0f} s")


def send(url: str, request: dict, timeout: float) -> dict:
    """One completion -> {"id", "sent", "done", "tokens", "error"}."""
    body = {"prompt": [request["prompt"]], "max_tokens": request["max_tokens"], "temperature": 0,
            "ignore_eos": True}
    out = {"id": request["id"], "sent": time.time(), "tokens": None, "error": None}
    try:
        out["tokens"] = post(url + "/v1/completions", body, timeout)["choices"][0]["generation_token_ids"]
    except Exception as err:  # an HTTP error or a timeout is recorded, the load goes on
        out["error"] = repr(err)
    out["done"] = time.time()
    return out


def drive(url: str, requests: list[dict], timeout: float) -> list[dict]:
    """Open loop: every request on its own thread at its time; -> the answers in request order."""
    results: list = [None] * len(requests)

    def one(i: int) -> None:
        results[i] = send(url, requests[i], timeout)

    threads, start = [], time.monotonic()
    for i, r in enumerate(requests):
        time.sleep(max(0.0, start + r["at"] - time.monotonic()))
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(timeout)
    return [r or {"id": q["id"], "error": "no answer (thread still waiting)"} for r, q in zip(results, requests)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan")
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--ready-s", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--request-s", type=float, default=600.0, help="seconds one request may take")
    a = p.parse_args(argv)
    with open(a.plan) as f:
        plan = json.load(f)
    wait_ready(a.url, a.ready_s)
    warm = send(a.url, plan["warmup"], a.request_s)
    if warm["error"]:
        raise SystemExit(f"client: the warm-up request failed: {warm['error']}")
    out = {rate: drive(a.url, reqs, a.request_s) for rate, reqs in plan["rates"].items()}
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
