"""A rank that fails tells the launcher, which kills the ranks left stuck: the job ends soon after, the failure named.

    reporting()      the per-rank entries (launch.run_entry, launch.main) run inside it: an exception, or a
                     non-zero SystemExit, is written to <dir>/rank<R> before it propagates (dir: the launcher's,
                     config.environment().failure_dir; nothing is written without one, e.g. ranks started by
                     srun). With or without a launcher, a RuntimeError that is not a PeerError gets a note (its
                     traceback ends with it) naming the first PeerError this process made, from any thread
                     (transport.first_peer_error: gloo's "pair closure" of a collective names no peer)
    Watch()          the launcher's side, polled by launch.torchrun: the first report is said on stderr (the
                     rank, its error); every rank still running GRACE_S later is killed with its session
                     (SIGKILL, torchrun's own last step). A stop the user asked for (`disarm`: SIGTERM to the
                     launcher) keeps torchrun's shutdown grace whole

Why: torchrun answers a failed rank with SIGTERM to the others, then SIGKILL after its --shutdown-timeout
(30 s); a stopped or hung rank never exits on SIGTERM, so such a job always waited the whole grace. The grace
stays as it is for every other stop: a server's orderly stop and Megatron's --exit-signal-handler checkpoint
need it, while a job whose rank failed has neither to wait for (its process groups are unusable). A healthy
rank exits on torchrun's SIGTERM well within GRACE_S; only a stuck one is left to kill.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time

from ...config import ENV_VARS, environment

GRACE_S = 5.0  # from the first failure report to the SIGKILL of the ranks still running
PEER_WAIT_S = 1.0  # how long an error of another kind waits for the peer error that caused it (another thread's)


@contextlib.contextmanager
def reporting():
    """Run a rank's work; a failure is reported to the launcher and propagates (module docstring)."""
    try:
        yield
    except SystemExit as err:
        if err.code not in (None, 0):
            _report(f"SystemExit: {err.code}")
        raise
    except Exception as err:
        _report(_described(err))
        raise


def _described(err: Exception) -> str:
    """`Type: message`, with the first peer error this process made where `err` is of another kind."""
    from ...runtime import PeerError, first_peer_error

    text = f"{type(err).__name__}: {err}"
    if isinstance(err, PeerError) or not isinstance(err, RuntimeError):  # gloo's errors are RuntimeErrors
        return text
    cause = first_peer_error(PEER_WAIT_S if _distributed() else 0.0)
    if cause is not None:
        note = f"the first peer failure on this rank: {type(cause).__name__}: {cause}"
        err.add_note(note)
        text += f" ({note})"
    return text


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _report(text: str) -> None:
    where = environment().failure_dir
    if not where:
        return
    name = f"rank{os.environ.get('RANK', '')}"  # torchrun's variable
    try:
        with open(os.path.join(where, f".{name}"), "w") as f:
            f.write(" ".join(text.split()))
        os.replace(os.path.join(where, f".{name}"), os.path.join(where, name))  # whole, or not there
    except OSError:
        pass  # the launcher is gone or its folder too: the error itself still propagates


class Watch:
    """The launcher's side (module docstring): a folder for the reports, polled with torchrun's pid."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="flashoverlap-launch-")
        self.armed, self.failed_at, self.failed = True, None, ""

    def env(self) -> dict:
        """What the ranks' environment gets: where to report."""
        return {ENV_VARS["failure_dir"]: self.dir}

    def disarm(self) -> None:
        """A stop the user asked for: torchrun's own grace applies."""
        self.armed = False

    def poll(self, torchrun_pid: int) -> None:
        if not self.armed:
            return
        if self.failed_at is None:
            self._first_report()
        elif time.monotonic() - self.failed_at >= GRACE_S:
            self.armed = False
            for pid, rank, state in _ranks(torchrun_pid):
                _say(f"killing rank {rank} (pid {pid}, {state}): still running {GRACE_S:g} s after "
                     f"{self.failed} failed")
                _kill_session(pid)

    def _first_report(self) -> None:
        reports = sorted((os.path.getmtime(p), n, p) for n in os.listdir(self.dir) if not n.startswith(".")
                         for p in [os.path.join(self.dir, n)])
        if not reports:
            return
        self.failed_at, (_, name, path) = time.monotonic(), reports[0]
        self.failed = f"rank {name[4:]}"
        with open(path) as f:
            text = f.read()
        _say(f"{self.failed} failed: {text}. The ranks still running in {GRACE_S:g} s are killed (a stopped or "
             f"hung rank never exits on torchrun's SIGTERM)")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _kill_session(pid: int) -> None:
    """SIGKILL to the rank's process group (torchrun starts each rank as a session leader), else to the rank."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _say(line: str) -> None:
    print(f"flashoverlap-launch: {line}", file=sys.stderr, flush=True)


def _ranks(torchrun_pid: int) -> list[tuple[int, str, str]]:
    """torchrun's children (its ranks) as (pid, RANK, state) from /proc (Linux; none elsewhere)."""
    out = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if int(ppid) == torchrun_pid and state != "Z":
            out.append((int(name), env.get(b"RANK", b"?").decode(), _STATES.get(state, state)))
    return out


_STATES = {"T": "stopped", "t": "stopped (traced)", "D": "in uninterruptible sleep", "S": "sleeping", "R": "running"}
