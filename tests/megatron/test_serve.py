"""Megatron's OpenAI-compatible HTTP server (`python -m megatron_flashoverlap.serve`: the wheel's
MegatronAsyncLLM.serve, coordinator mode) answers one completion request identically stock and --flash-overlap,
and stops cleanly on SIGTERM; a request out of range (top_p 2.0, logprobs 1000) gets a 400 naming the field and the
server keeps serving; a start on a taken port fails with its error and leaves no process behind; a rank killed
mid-request (rank 0, rank 1) fails the request with a 503 naming the cause and ends the job, nothing left.

Tier 2 (the shared pretrain() start-up saves the checkpoint; then two torchrun starts, one server per arm, TP=2 on
2 CPU ranks over gloo; newest lane: the high-level inference API ships in the 0.19 wheel; needs the `serve`
extra, pinned in requirements/newest.txt). One HTTP request: four token-id prompts of mixed lengths, greedy
(temperature 0), 6 tokens each (ignore_eos: every answer has its full length), log-probs on. Exact: tokens and
log-probs are compared to the bit (same weights, same core attention; each TP all-reduce sums two partials, a + b
== b + a). The server runs in its own session with a start-up, a request and a stop deadline; whatever the test
meets, every process it started is gone when it ends (psutil: the launcher's descendants, killed by id where the
SIGTERM did not stop them).
"""
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.megatron.test_train_then_generate import JOBS as TTG_JOBS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples.train_then_generate import MODEL  # noqa: E402  (the tiny GPT of the train-then-generate example)

# the checkpoint of the train-then-generate test's training job (the same tiny GPT, 2 iterations): one job saves
# it for both tests in the shared start-up
SAVE = TTG_JOBS[0]
CKPT = SAVE.argv[SAVE.argv.index("--save") + 1]
PROMPTS = [[1, 5, 9, 17, 3], [4] * 11, list(range(20, 47)), [7, 7]]
TOKENS = 6
START_S, REQUEST_S, STOP_S = 300, 120, 60  # seconds: torchrun + Megatron + the coordinator; one request; SIGTERM
ARMS = ("stock", "flash")
SITES = "GEMM sites: dense[1-2]: qkv=auto (all-reduce, no SP)"  # the flag alone: auto


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: the server binds it ~30 s later, and meanwhile the
    suite's gloo, torchrun and zmq sockets take ephemeral ports (one of them took a port bind(0) had returned)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(low // 2, low), 200):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise AssertionError(f"no free port in {low // 2}-{low - 1}")


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Until GET /health answers 200; the server exiting or START_S passing fails with its log's tail."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited ({proc.returncode}) before serving:\n{log.read_text()[-4000:]}"
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(1)
    raise AssertionError(f"the server did not answer /health within {START_S} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> tuple:
    """SIGTERM to the launcher; -> (seconds to exit or None, pids still alive after STOP_S: then killed)."""
    family = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    t0 = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_S)
        seconds = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        seconds = None
    _, alive = psutil.wait_procs(family, timeout=max(1.0, STOP_S - (time.monotonic() - t0)))
    for p in [*alive, *([psutil.Process(proc.pid)] if proc.poll() is None else [])]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(timeout=10)
    return seconds, [p.pid for p in alive]


def start(arm: str, ckpt: str, port: int, log: Path) -> subprocess.Popen:
    """`python -m megatron_flashoverlap.serve --cpu --nproc-per-node 2 ...` in its own session, output to `log`."""
    cmd = [sys.executable, "-m", "megatron_flashoverlap.serve", "--cpu", "--nproc-per-node", "2", *MODEL,
           "--micro-batch-size", "1", "--load", ckpt, "--host", "127.0.0.1", "--port", str(port),
           *(["--flash-overlap"] if arm == "flash" else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def serve_once(arm: str, ckpt: str, tmp: Path, tries: int = 3) -> dict:
    """Start the server of `arm`, send the request, stop it -> {"response", "log", "stop_s", "left"}. A start that
    lost its port to another process between the choice and the bind is retried on another port (`tries`)."""
    try:
        return _serve_once(arm, ckpt, tmp)
    except AssertionError as err:
        if tries <= 1 or "Address already in use" not in str(err):
            raise
    return serve_once(arm, ckpt, tmp, tries - 1)


BAD = {"top_p": 2.0, "logprobs": 1000}  # each dropped Megatron's engine (every later request hung) before the checks


def rejected(url: str, body: dict) -> tuple:
    """(status, the error's message) of a request the server must refuse."""
    try:
        post(url, body, REQUEST_S)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)["error"]["message"]
    return 200, ""


def _serve_once(arm: str, ckpt: str, tmp: Path) -> dict:
    port, log = free_port(), tmp / f"serve-{arm}.log"
    url, proc = f"http://127.0.0.1:{port}", start(arm, ckpt, port, log)
    body = {"prompt": PROMPTS, "max_tokens": TOKENS, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    try:
        wait_ready(proc, url, log)
        refused = {k: rejected(url + "/v1/completions", {**body, "temperature": 0.5, k: v}) for k, v in BAD.items()}
        response = post(url + "/v1/completions", body, REQUEST_S)  # the server still serves
    finally:
        seconds, left = stop(proc)
    return {"response": response, "refused": refused, "log": log.read_text(), "stop_s": seconds, "left": left}


def answers(response: dict) -> list:
    return [(c["prompt_token_ids"], c["generation_token_ids"], c["generation_log_probs"], c["text"])
            for c in sorted(response["choices"], key=lambda c: c["index"])]


@pytest.mark.newest_only
@pytest.mark.pretrain(SAVE)
def test_the_http_server_answers_identically_with_flash_overlap_and_stops_cleanly(pretrain, tmp_path):
    pretrain(SAVE.name).check()
    ckpt = CKPT.replace("{tmp}", str(pretrain.tmp))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two servers side by side: each mostly waits
        runs = dict(zip(ARMS, pool.map(lambda arm: serve_once(arm, ckpt, tmp_path), ARMS)))
    for arm, run in runs.items():
        got = answers(run["response"])
        assert [p for p, *_ in got] == PROMPTS, arm
        assert all(len(t) == TOKENS and len(lp) == TOKENS for _, t, lp, _ in got), (arm, got)
        assert run["stop_s"] is not None and not run["left"], (arm, run["stop_s"], run["left"], run["log"][-3000:])
        assert "\nserver stopped\n" in run["log"], run["log"][-3000:]
        for field, (status, message) in run["refused"].items():  # a 400 naming the field, before the engine
            assert status == 400 and message.startswith(f"{field}:"), (arm, field, status, message)
    assert answers(runs["stock"]["response"]) == answers(runs["flash"]["response"])
    assert len({tuple(t) for _, t, _, _ in answers(runs["stock"]["response"])}) > 1, "the prompts answer differently"
    assert "GEMM sites: stock\n" in runs["stock"]["log"]
    assert SITES in runs["flash"]["log"]  # ours ran


def _taken_port(ckpt: str, tmp: Path) -> dict:
    """Start a server on a port already listening; -> {"rc", "log", "alive", "left"} once it ended."""
    log = tmp / "serve-taken.log"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = start("stock", ckpt, taken.getsockname()[1], log)
        try:
            family, deadline = [], time.monotonic() + START_S
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(psutil.Error):
                    family = list({p.pid: p for p in [*family, *psutil.Process(proc.pid).children(recursive=True)]}
                                  .values())
                time.sleep(0.5)
            rc = proc.poll()
        finally:
            _, left = stop(proc)
    _, alive = psutil.wait_procs(family, timeout=10)
    return {"rc": rc, "log": log.read_text(), "alive": alive, "left": left}


def _rank(launcher: psutil.Process, rank: str) -> psutil.Process:
    """The rank process `rank` of the launcher's torchrun (not one of its children, which inherit RANK)."""
    family = launcher.children(recursive=True)
    ranks = [p for p in family if p.environ().get("RANK") == rank and p.parent().environ().get("RANK") != rank]
    assert len(ranks) == 1, [(p.pid, p.cmdline()[:3]) for p in family]
    return ranks[0]


# a request still in flight at the kill: 4 short prompts, as many tokens as the 64 positions allow (the checks'
# 400 otherwise); greedy
IN_FLIGHT = {"prompt": [[1, 5, 9, 17, 3], [7, 7], [4] * 4, [9, 3, 1]], "max_tokens": 59, "temperature": 0,
             "ignore_eos": True}
CAUSES = {"0": "the inference engine stopped: rank 0 (pid {pid}) ended",  # seen by the frontend (its parent gone)
          "1": "the inference engine on rank 0 stopped on an error (RuntimeError"}  # rank 0's engine lost its peer


def _killed(victim: str, ckpt: str, tmp: Path) -> dict:
    """Serve, send IN_FLIGHT, kill -9 rank `victim` 0.3 s later; -> what the request, /health and the launcher
    did: {"outcome": {"request": (status, message), "health_s", "exit_s"}, "rc", "rank0", "log", "alive",
    "left"}."""
    port, log = free_port(), tmp / f"serve-kill{victim}.log"
    url, proc = f"http://127.0.0.1:{port}", start("stock", ckpt, port, log)
    family, outcome = [], {}
    try:
        wait_ready(proc, url, log)
        family = psutil.Process(proc.pid).children(recursive=True)
        rank0 = _rank(psutil.Process(proc.pid), "0").pid

        def request():
            try:
                post(url + "/v1/completions", IN_FLIGHT, REQUEST_S)
                outcome["request"] = (200, "answered")
            except urllib.error.HTTPError as err:
                outcome["request"] = (err.code, json.load(err)["error"]["message"])
            except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
                outcome["request"] = (None, type(err).__name__)
        import threading
        asker = threading.Thread(target=request)
        asker.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        _rank(psutil.Process(proc.pid), victim).kill()
        while time.monotonic() - t0 < 10 and "health_s" not in outcome:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    pass
            except (urllib.error.URLError, ConnectionError, TimeoutError):  # HTTPError (a 503) included
                outcome["health_s"] = time.monotonic() - t0
            time.sleep(0.2)
        asker.join(REQUEST_S)
        rc = proc.wait(timeout=STOP_S)
        outcome["exit_s"] = time.monotonic() - t0
    finally:
        _, left = stop(proc)
    _, alive = psutil.wait_procs(family, timeout=10)
    return {"outcome": outcome, "rc": rc, "rank0": rank0, "log": log.read_text(), "alive": alive, "left": left}


@pytest.fixture(scope="module")
def failed(pretrain, tmp_path_factory):
    """{"taken" | "kill0" | "kill1": future of the run's record}: the three failing servers run side by side
    (each mostly waits on a start-up, a deadline or a stop)."""
    pretrain(SAVE.name).check()
    ckpt, tmp = CKPT.replace("{tmp}", str(pretrain.tmp)), tmp_path_factory.mktemp("serve-failed")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        yield {"taken": pool.submit(_taken_port, ckpt, tmp), "kill0": pool.submit(_killed, "0", ckpt, tmp),
               "kill1": pool.submit(_killed, "1", ckpt, tmp)}


@pytest.mark.newest_only
@pytest.mark.pretrain(SAVE)
def test_a_taken_port_fails_the_start_with_its_error_and_leaves_no_process(failed):
    """The engines and Megatron's coordinator already run when the frontend cannot bind: rank 0 stops them, then
    raises; the launcher exits non-zero well before torchrun's own teardown (30 s) would have to kill anything."""
    run = failed["taken"].result()
    rc, text = run["rc"], run["log"]
    assert rc not in (None, 0), f"the server did not fail on a taken port (exit {rc}):\n{text[-3000:]}"
    assert "OSError: [Errno 98] Address already in use" in text and "Unable to shutdown" not in text, text[-3000:]
    assert not run["alive"] and not run["left"], (run["alive"], run["left"])


@pytest.mark.newest_only
@pytest.mark.pretrain(SAVE)
@pytest.mark.parametrize("victim", ["0", "1"])
def test_a_killed_rank_fails_the_request_in_flight_with_a_503_naming_it_and_ends_the_job(failed, victim):
    """kill -9 of a rank mid-request. Rank 0: its HTTP frontend sees its parent gone and answers 503 naming it, then
    the launcher (a subreaper) kills the frontend and Megatron's coordinator it adopted (they used to outlive rank 0,
    /health answering 200 and every request hanging). Rank 1: rank 0's engine fails on the lost peer; rank 0 has
    its frontend answer 503 naming that error, stops it and exits 1. Either way: the request in flight gets the
    503 (not a closed connection), /health stops answering 200 within 10 s, the launcher exits non-zero, and no
    process is left."""
    run = failed[f"kill{victim}"].result()
    outcome, text, rc = run["outcome"], run["log"], run["rc"]
    status, message = outcome.get("request", (None, "no answer"))
    assert status == 503 and CAUSES[victim].format(pid=run["rank0"]) in message, (outcome, text[-3000:])
    assert outcome.get("health_s") is not None, (outcome, text[-3000:])
    assert rc not in (0, None), (outcome, rc)  # within STOP_S: not torchrun's grace for an orderly stop
    if victim == "0":
        assert "a rank ended leaving processes" in text, text[-3000:]
    assert not run["alive"] and not run["left"], (run["alive"], run["left"])
