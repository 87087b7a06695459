"""A peer that stops inside one of our rings ends the training job (`python -m megatron_flashoverlap.pretrain_gpt`,
the tiny GPT on 2 CPU ranks over gloo, --flash-overlap) within the configured timeout + 30 s: the waiting rank
raises PeerTimeoutError naming the operator, the ring step, the group, the stopped peer's global rank and the
limit, and exits non-zero.

Tier: Megatron on gloo, one job per case, the four started side by side (newest lane: the entry needs
megatron.training). The fault:
tests/support/fault/sitecustomize.py makes rank 1 SIGSTOP itself (what `kill -STOP` does) before its FAULT_CALL-th
post inside one of our operators. The bound: FLASHOVERLAP_TIMEOUT_S = 5 (smaller than the group's own timeout,
Megatron's --distributed-timeout-minutes, 10 min by default, so ours applies; tests/gloo/test_transport.py shows
the group's own timeout applying where it is the smaller).

    forward ring      AllGatherMatmul.forward       TP = 2 with SP, under the launcher (torchrun)
    backward ring     MatmulReduceScatter.backward  TP = 2 with SP, under the launcher
    DP fusion         matmul_wgrad_reduce_scatter   TP = 1, DP = 2, `dp: {fuse: all}`, on the DP worker thread,
                                                    under the launcher and with the ranks started by hand
                                                    (as srun would): the job ends when rank 0 exits
Under the launcher the stopped rank never ends on torchrun's SIGTERM: the launcher, told by the failed rank,
kills it a short grace later (megatron/cli/failures.py) and says so, naming the failed rank. In the DP case
rank 0 usually fails first in a stock collective on the connection our timed wait closed (gloo's "pair
closure"): its error carries the note naming our PeerTimeoutError. Every process a test started is gone when
it ends (psutil: killed by id where it did not exit).
"""
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from examples.train_then_generate import MODEL
from megatron_flashoverlap.config import ENV_VARS
from megatron_flashoverlap.megatron.cli import failures

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "tests" / "support" / "fault"
TRAIN = ["--global-batch-size", "2", "--lr", "1e-4", "--log-interval", "1", "--eval-iters", "0", "--eval-interval",
         "1000000", "--mock-data", "--train-iters", "100000", "--flash-overlap"]
TP = MODEL.index("--tensor-model-parallel-size") + 1  # MODEL: TP = 2
# configs/flash.yaml: the TP rings run from the first step (the flag alone, auto, might keep stock at a site)
TP_SP = [*MODEL, *TRAIN, "--micro-batch-size", "2", "--sequence-parallel", "--flash-overlap-config",
         str(ROOT / "configs" / "flash.yaml")]
DP_FUSED = [*MODEL[:TP], "1", *MODEL[TP + 1:], *TRAIN, "--micro-batch-size", "1", "--use-distributed-optimizer",
            "--overlap-grad-reduce"]  # TP = 1, DP = 2: one micro-batch of 1 per rank
BOUND_S, SLACK_S, START_S = 5, 30, 240
TP_GROUP, DP_GROUP = "TENSOR_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP_WITH_CP"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(where: str, call: int, args: list, torchrun: bool, log: Path) -> tuple:
    """Start the job with the fault at `where`'s `call`-th post; -> (seconds from the fault to the end, exit code,
    log text)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOK), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "FAULT_IN": where, "FAULT_CALL": str(call),
           "FAULT_RANK": "1", "FLASHOVERLAP_TIMEOUT_S": str(BOUND_S),
           "TORCH_COMPILE_DISABLE": "1"}  # Megatron's start-up compiles fused kernels a CPU run never calls
    cmd = [sys.executable, "-m", "megatron_flashoverlap.pretrain_gpt", "--cpu", *args]
    out = open(log, "w")
    if torchrun:
        procs = [subprocess.Popen([*cmd[:4], "--nproc-per-node", "2", *cmd[4:]], cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)]
    else:
        port = str(_port())
        procs = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                                      "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                      "MASTER_PORT": port},
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True) for r in range(2)]
    family = {}
    try:
        t0, deadline = None, time.monotonic() + START_S
        while procs[0].poll() is None and time.monotonic() < deadline:
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    family.update({c.pid: c for c in [psutil.Process(p.pid), *psutil.Process(p.pid).children(True)]})
            if t0 is None and "fault: rank 1 stops itself" in log.read_text():
                t0 = time.monotonic()
                deadline = t0 + BOUND_S + SLACK_S + 15  # past the bound: a slow end is measured, not cut
            time.sleep(0.2)
        seconds = None if t0 is None or procs[0].poll() is None else time.monotonic() - t0
        return seconds, procs[0].poll(), log.read_text()
    finally:
        for p in [*family.values(), *(psutil.Process(p.pid) for p in procs if p.poll() is None)]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        for p in procs:
            p.wait(timeout=30)
        out.close()
        _, alive = psutil.wait_procs(list(family.values()), timeout=10)
        assert not alive, alive


def _check(seconds, rc, text: str, where: str, group: str) -> None:
    """Ended, non-zero, within the timeout + 30 s, the error naming operator, step, group, peer and limit."""
    assert seconds is not None, f"the job did not end after the fault in {where}:\n{text[-4000:]}"
    assert rc not in (0, None) and seconds < BOUND_S + SLACK_S, (rc, seconds, text[-3000:])
    error = next((line for line in text.splitlines() if "PeerTimeoutError: " in line), "")
    assert f"PeerTimeoutError: {where}: step " in error and "global rank 1" in error, text[-4000:]
    assert f"'{group}'" in error and f"0:00:0{BOUND_S}" in error, error


def _check_launcher(text: str, where: str) -> None:
    """The launcher named the failed rank and its error, and killed the stopped one (torchrun's SIGTERM cannot).
    torchrun's own summary is not the record: where rank 0 is still exiting at the kill (seen in the fused-DP case
    on a loaded host: still running 15 s after its report) it names the kill, not rank 0's exit code 1."""
    said = next((line for line in text.splitlines() if line.startswith("flashoverlap-launch: rank 0 failed: ")), "")
    assert f"PeerTimeoutError: {where}: step " in said, text[-4000:]
    assert any(line.startswith("flashoverlap-launch: killing rank 1 (pid ") and "stopped" in line
               for line in text.splitlines()), text[-4000:]



def _dp_args(tmp_path: Path) -> list:
    yaml = tmp_path / "dp_all.yaml"
    yaml.write_text("dp: {fuse: all}\n")
    return [*DP_FUSED, "--flash-overlap-config", str(yaml)]


# the four jobs: (where the fault is, its post, the job's flags, under the launcher); they run side by side (each
# mostly waits: the bound, the launcher's grace), so the module costs about one job's wall time, not four
CASES = {"forward": ("AllGatherMatmul.forward", 8, "tp", True),
         "backward": ("MatmulReduceScatter.backward", 8, "tp", True),
         "dp": ("matmul_wgrad_reduce_scatter", 12, "dp", True),
         "dp-by-hand": ("matmul_wgrad_reduce_scatter", 12, "dp", False)}


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """{case: future of (seconds from the fault to the end, exit code, log text)}: every case's job started at
    once on first use."""
    tmp = tmp_path_factory.mktemp("faults")
    flags = {"tp": TP_SP, "dp": _dp_args(tmp)}  # the two DP cases read the same YAML
    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
        yield {name: pool.submit(_run, where, call, flags[args], torchrun, tmp / f"{name}.log")
               for name, (where, call, args, torchrun) in CASES.items()}


@pytest.mark.newest_only
def test_a_peer_stopped_in_a_forward_ring_ends_the_launched_job(ended):
    seconds, rc, text = ended["forward"].result()
    _check(seconds, rc, text, "AllGatherMatmul.forward", TP_GROUP)
    _check_launcher(text, "AllGatherMatmul.forward")


@pytest.mark.newest_only
def test_a_peer_stopped_in_a_backward_ring_ends_the_launched_job(ended):
    seconds, rc, text = ended["backward"].result()
    _check(seconds, rc, text, "MatmulReduceScatter.backward", TP_GROUP)
    _check_launcher(text, "MatmulReduceScatter.backward")


@pytest.mark.newest_only
def test_a_peer_stopped_in_the_fused_dp_ring_ends_the_launched_job(ended):
    seconds, rc, text = ended["dp"].result()
    assert "DP reduce-scatter inside the wgrad GEMM of 8 weight(s)" in text, text[-3000:]  # the fused path runs
    _check(seconds, rc, text, "matmul_wgrad_reduce_scatter", DP_GROUP)
    _check_launcher(text, "matmul_wgrad_reduce_scatter")


@pytest.mark.newest_only
def test_a_peer_stopped_in_the_fused_dp_ring_ends_rank_0_started_by_hand(ended):
    """No launcher (srun's start): rank 0 itself exits at the deadline, naming the peer."""
    seconds, rc, text = ended["dp-by-hand"].result()
    _check(seconds, rc, text, "matmul_wgrad_reduce_scatter", DP_GROUP)
    assert rc == 1 and "flashoverlap-launch" not in text


# a stand-in for torchrun: its one child plays rank 1, stopped as a peer stopped inside a ring (`kill -STOP`)
STOPPED_CHILD = ("import os, subprocess, sys, time\n"
                 "subprocess.Popen([sys.executable, '-c', 'import os, signal; os.kill(os.getpid(), signal.SIGSTOP)'],"
                 " env={**os.environ, 'RANK': '1'}, start_new_session=True)\n"
                 "time.sleep(60)\n")


def _failed_rank_0(watch, monkeypatch) -> None:
    """Rank 0 fails inside `reporting()` with the launcher's folder in its environment."""
    monkeypatch.setenv(ENV_VARS["failure_dir"], watch.dir)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError), failures.reporting():
        raise ValueError("the first error")


def _poll_until(watch, parent, seconds: float) -> list:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watch.poll(parent.pid)
        time.sleep(0.05)
    return _children(parent.pid)


def _children(pid: int) -> list[int]:
    return [p for p, _, _ in failures._ranks(pid)]


@pytest.mark.parametrize("user_stop", [False, True], ids=["failure", "user_stop"])
def test_a_reported_failure_kills_the_stopped_rank_after_the_grace_a_user_stop_does_not(monkeypatch, capfd,
                                                                                       user_stop):
    """launch.torchrun's watch (megatron/cli/failures.py): the failed rank's report is said naming it and its
    error, and the rank still there GRACE_S later, stopped (SIGTERM cannot end it), is killed; after the user's
    stop (SIGTERM to the launcher: `disarm`) nothing is killed: torchrun's own grace applies. No Megatron: a
    stand-in parent plays torchrun, its child the stopped rank 1, this test rank 0."""
    monkeypatch.setattr(failures, "GRACE_S", 0.5)
    watch = failures.Watch()
    parent = subprocess.Popen([sys.executable, "-c", STOPPED_CHILD])
    try:
        end = time.monotonic() + 30
        while [s for _, _, s in failures._ranks(parent.pid)] != ["stopped"] and time.monotonic() < end:
            time.sleep(0.05)
        stopped = _children(parent.pid)
        assert len(stopped) == 1, failures._ranks(parent.pid)
        _failed_rank_0(watch, monkeypatch)
        if user_stop:
            watch.disarm()
        left = _poll_until(watch, parent, 1.5)
        err = capfd.readouterr().err
        if user_stop:
            assert left == stopped and "flashoverlap-launch" not in err, err
            return
        assert left == [], left
        assert "flashoverlap-launch: rank 0 failed: ValueError: the first error." in err, err
        assert f"flashoverlap-launch: killing rank 1 (pid {stopped[0]}, stopped)" in err, err
    finally:
        for pid in _children(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
        watch.close()

