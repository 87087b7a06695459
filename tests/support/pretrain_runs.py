"""Many Megatron `pretrain()` runs behind few torchrun start-ups (the caller side of pretrain_runner.py).

A start-up (torchrun, N ranks importing torch and Megatron) costs 15-30 s on 2 cores; a tiny run after it a few
seconds. Tests declare the runs they read with the `pretrain` marker; the session fixture `pretrain`
(tests/megatron/conftest.py) starts, the first time one of them is read, every declared job of the selected
tests in `batches(jobs)` side by side: one batch per world size, two for a world of many jobs:

    @pytest.mark.pretrain(Job("tp2-stock", "launch", [SCRIPT, *ARGS]), Job("tp2-flash", ...))
    def test_x(pretrain):
        result = pretrain("tp2-stock")          # -> Result: losses, sites line, logs, error

In a job's argv, "{tmp}" stands for a folder of the session (checkpoints; the YAMLs of `Job.files`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNER = "tests.support.pretrain_runner"  # -m from the checkout: tests/support/profile.py must not shadow the stdlib
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.eE+-]+)")
SITES = "GEMM sites: "
STARTUP_S, JOB_S = 180, 150  # seconds: a job's limit (the runner's), a batch's: start-up plus each job's
FIRST, DEFAULT, AFTER, LAST = 0, 1, 2, 3  # Job.order
# --flash-overlap with ours forced at every GEMM site (configs/flash.yaml): what a test of our operators inside
# Megatron runs; the flag alone runs `auto`, which may keep stock at a site where flash does not win
FLASH = ("--flash-overlap", "--flash-overlap-config", str(ROOT / "configs" / "flash.yaml"))
ENTRIES = {"megatron_flashoverlap.pretrain_gpt": "pretrain_gpt", "megatron_flashoverlap.generate": "generate"}


@dataclasses.dataclass(frozen=True)
class Job:
    """One per-rank user command: entry "pretrain_gpt" (the project entry) or "launch" (the launcher), its argv
    (the launcher options --cpu first, as a user types them; no --nproc-per-node: the batch is already the
    ranks), the world size, `order` (a batch runs jobs by order, then as declared: FIRST, ..., LAST; expected
    failures go LAST, since one that hangs ends the batch) and `files`: (path under {tmp}, text) pairs written
    before the batch starts (YAMLs the job reads)."""

    name: str
    entry: str
    argv: tuple
    world: int = 2
    order: int = DEFAULT
    files: tuple = ()


@dataclasses.dataclass
class Result:
    """What one job logged: {iteration: lm loss}, the GEMM sites line (rank 0), each rank's log, the error."""

    losses: dict
    sites: str | None
    logs: list
    error: str | None

    @property
    def text(self) -> str:
        return "\n".join(self.logs)

    def check(self) -> "Result":
        """self, or AssertionError with the job's error and the tail of its logs."""
        assert self.error is None, f"{self.error}\n--- log tail ---\n{self.text[-3000:]}"
        return self


# Every training job of a batch runs in a process that earlier jobs left multi-threaded (gloo's and our
# communication threads); Megatron's data loader would fork its workers from it, and a fork of a multi-threaded
# process may only call async-signal-safe functions (a worker segfaulted in CI). In-process loading reads the
# same samples in the same order (Megatron's sampler decides them, not the workers).
IN_PROCESS = ("--num-workers", "0")
# Megatron builds a mock dataset's indices (about 2.1 M samples at seq 32) on rank 0, then, after a barrier, on
# every other rank, in every job: 14-19 s of a two-rank batch's 119-129 s. With a cache folder (Megatron's own
# --data-cache-path) rank 0 writes them once per dataset configuration (its hash names the files) and the other
# ranks and later jobs of the batch read them back: the same indices, so the same samples in the same order. One
# folder per batch, since batches run side by side and two writers of one file would race.
DATA_CACHE = "--data-cache-path"


# A batch keeps its 2 ranks busy about two thirds of the time (measured: 134 s of wall, 90 s of CPU per rank, for
# the suite's 58 two-rank jobs); batches started side by side fill the rest. So the session runs every world size's
# batch at once, and a world with more than SPLIT_ABOVE jobs as two batches.
SPLIT_ABOVE = 20


def batches(jobs: list) -> list:
    """`jobs` as the batches the session starts side by side: one per world size, a world of more than SPLIT_ABOVE
    jobs in two. Jobs that must share a process stay together: the same command (a run compared with itself run
    later, tests/megatron/test_pretrain_runner.py) and every job naming the same "{tmp}/<name>" (a checkpoint one
    job saves and another loads, a YAML both read)."""
    out = []
    for world in sorted({j.world for j in jobs}):
        mine = [j for j in jobs if j.world == world]
        if len(mine) <= SPLIT_ABOVE:
            out.append(mine)
            continue
        # whole units in declaration order up to about half the jobs: a test's stock and flash arms, declared
        # together, land in one part, and each part mixes stock and flash runs (not all of one kind in each)
        first: list = []
        for unit in sorted(_units(mine), key=lambda u: mine.index(u[0])):
            if len(first) + len(unit) / 2 > len(mine) / 2:
                break
            first += unit
        out += [sorted(first, key=mine.index), [j for j in mine if j not in first]]
    return out


def _units(jobs: list) -> list:
    """`jobs` grouped so that two jobs with the same argv or a shared "{tmp}/<name>" are in one group."""
    def keys(job):
        return {("argv", job.argv)} | {("tmp", a.split("{tmp}/", 1)[1].split("/", 1)[0])
                                       for a in job.argv if "{tmp}/" in a}
    groups: list = []  # [(keys, jobs)]
    for job in jobs:
        mine, joined = keys(job), [job]
        for g in [g for g in groups if g[0] & mine]:
            groups.remove(g)
            mine, joined = mine | g[0], g[1] + joined
        groups.append((mine, joined))
    return [g[1] for g in groups]


def run_batch(jobs: list, out: Path, tmp: Path) -> dict:
    """Run `jobs` (one world size) in order behind one torchrun start-up; -> {name: Result}."""
    world = {j.world for j in jobs}
    assert len(world) == 1, f"one world size per batch, got {world}"
    out.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        for rel, text in job.files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
    jobs = sorted(jobs, key=lambda j: j.order)  # stable: declaration order within an order
    spec = [{"name": j.name, "entry": j.entry, "argv": [a.replace("{tmp}", str(tmp)) for a in j.argv]
             + (_in_process(j.argv, out) if j.entry in ("pretrain_gpt", "launch") else [])} for j in jobs]
    (out / "jobs.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world.pop()}",
           "-m", RUNNER, str(out / "jobs.json"), str(out), str(JOB_S)]
    # TORCH_COMPILE_DISABLE: Megatron compiles some activations unconditionally (@jit_fuser, e.g. gpt-oss's
    # quick_gelu); inductor's C++ build took 20 s of the first two iterations of the gptoss rows on 2 cores (the
    # whole rest of such a job: 2 s). Both arms of every row then run the same eager function.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TORCH_COMPILE_DISABLE": "1"}
    why = None
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=STARTUP_S + JOB_S * len(jobs))
        if proc.returncode != 0:
            why = f"the batch exited {proc.returncode}: {proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired as err:
        why = f"the batch timed out after {err.timeout:.0f} s"
    return {j.name: read_result(out, j.name, why) for j in jobs}


def _in_process(argv: tuple, out: Path) -> list:
    """What a job runs with inside a batch besides its own argv: IN_PROCESS, and the batch's data cache where the
    job names none."""
    return [*IN_PROCESS, *([] if DATA_CACHE in argv else [DATA_CACHE, str(out / "data-cache")])]


def read_result(out: Path, name: str, why: str | None) -> Result:
    logs = [p.read_text(errors="replace") for p in sorted(out.glob(f"{name}.rank*.log"))]
    done = [p.read_text() for p in sorted(out.glob(f"{name}.rank*.done"))]
    errors = [d for d in done if d != "ok"]
    if not done or (why and len(done) < len(logs or [0])):
        errors.append(f"{name} did not finish ({why or 'no status written'})")
    losses = {}
    for log in logs:  # the last pipeline stage logs the loss
        losses.update({int(i): float(v) for i, v in LOSS.findall(log)})
    sites = [ln for ln in (logs[0] if logs else "").splitlines() if ln.startswith(SITES)]
    return Result(losses, sites[-1] if sites else None, logs, "\n".join(errors) or None)


def from_batch(pretrain, name: str, expected: dict, yaml: dict | None = None):
    """A stand-in for the subprocess module an example launches the project's entries with: the command must be
    an entry of ENTRIES with --cpu on 2 ranks and one of `expected`'s argument lists (arm -> args, "{tmp}" the
    session folder; a --flash-overlap-config YAML in them: the same file content as `yaml[arm]`), and its
    output is what that job's ranks logged in the batch (job `<name>-<arm>`). The example's own code builds the
    command and reads what the entry printed or wrote."""
    heads = [[sys.executable, "-m", module, "--cpu", "--nproc-per-node", "2"] for module in ENTRIES]

    def run(cmd, **kwargs):
        head = next((h for h in heads if cmd[:len(h)] == h), None)
        assert head is not None, f"not a project entry on 2 CPU ranks: {cmd}"
        args = list(cmd[len(head):])
        for arm, want in expected.items():
            want = [a.replace("{tmp}", str(pretrain.tmp)) for a in want]
            if yaml and arm in yaml and args[:-1] == want[:-1]:
                assert Path(args[-1]).read_text() == yaml[arm][1], arm
                args[-1] = want[-1]
            if args == want:
                job = pretrain(f"{name}-{arm}").check()
                return subprocess.CompletedProcess(cmd, 0, stdout="\n".join(job.logs), stderr="")
        raise AssertionError(f"the example asked for a run no job declares: {args}")
    return types.SimpleNamespace(run=run, TimeoutExpired=subprocess.TimeoutExpired)
