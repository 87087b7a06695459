"""Run a Megatron-LM pretrain script, unmodified, with `--flash-overlap` understood (and on CPU with `--cpu`).

    flashoverlap-launch [--cpu] [--nproc-per-node N] SCRIPT.py <megatron args> [--flash-overlap
        [--flash-overlap-config configs/flash.yaml]]
    torchrun --nproc-per-node N -m megatron_flashoverlap.launch [--cpu] SCRIPT.py ...   (the same, per rank)

With `--nproc-per-node N` the launcher starts torchrun itself (`--standalone`, N ranks, each running the
per-rank form). Per rank, in this order:

    --cpu        1. Megatron-LM arguments a CPU run needs and the user need not type (`CPU_DEFAULTS`) are
                    appended to argv, each only where the user did not give that flag: before Megatron
                    parses, so its validate_args sees them
                 2. `megatron_flashoverlap.megatron.cpu.enable()`: the shims for Megatron's CUDA-only calls
    always       3. a checkout whose dataset helpers are not compiled gets the installed megatron-core's
                    prebuilt `helpers_cpp*.so` (no `make` at start-up)
                 4. `megatron.training.arguments.parse_args` (which `parse_and_validate_args` calls by
                    module-global name) is wrapped: our flags added, `apply_flash_overlap_args` applied
                    (--spec megatron_flashoverlap.spec flashoverlap_layer, per-site config); and pretrain()'s
                    `setup_model_and_optimizer`: once the model is built, rank 0 prints the GEMM sites line
                    (what each GEMM site of each layer kind runs, and why where stock: megatron/sites.py)
                 5. the script runs as `__main__` (runpy), with `sys.argv` and `sys.path[0]` as `python
                    script.py` would set them: the script's folder first, so a checkout's `megatron/` is used

Without `--flash-overlap` the script trains stock (with `--cpu`: stock on CPU), so the two compare.
`patches/` holds the same two flag calls as a patch to `pretrain_gpt.py`, for users who prefer patching.
"""
from __future__ import annotations

import functools
import glob
import importlib.metadata
import importlib.util
import os
import runpy
import signal
import subprocess
import sys
from typing import Callable, Optional, Sequence

from .args import apply_flash_overlap_args, with_flash_overlap_args
from .failures import Watch, reporting

USAGE = ("usage: flashoverlap-launch [--cpu] [--nproc-per-node N] SCRIPT.py [megatron args] [--flash-overlap "
         "[--flash-overlap-config PATH]]")

# (flag, value or None for a switch, why a CPU run needs it)
CPU_DEFAULTS = (
    ("--distributed-backend", "gloo", "NCCL needs GPUs"),
    ("--transformer-impl", "local", "the default transformer_engine spec needs Transformer Engine (GPU)"),
    ("--no-gradient-accumulation-fusion", None, "stock needs apex's fused wgrad CUDA kernel"),
    ("--no-persist-layer-norm", None, "apex's persistent LayerNorm; torch's LayerNorm asserts it is off"),
    ("--no-rope-fusion", None, "fused RoPE is a Transformer Engine / apex kernel"),
    ("--no-bias-gelu-fusion", None, "torch.compile: inductor builds C++ at the first call (~10 s each on CPU)"),
    ("--no-bias-swiglu-fusion", None, "torch.compile, as above"),
    ("--no-bias-dropout-fusion", None, "torch.compile, as above"),
    ("--no-masked-softmax-fusion", None, "the fused (scaled, masked) softmax of bf16 / fp16 attention is a "
                                         "CUDA extension (scaled_masked_softmax_cuda); without it torch's runs"),
    ("--inference-dynamic-batching-buffer-size-gb", "1", "the dynamic engine's KV cache is host memory on CPU; "
     "the GPU default (40 GB) gives more request slots than tokens: DynamicInferenceContext asserts"),
)


def cpu_argv(argv: Sequence[str]) -> list[str]:
    """`argv` + every CPU default whose flag the user did not give (a given flag, any value, wins)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra = []
    for flag, value, _why in CPU_DEFAULTS:
        if flag not in given:
            extra += [flag] if value is None else [flag, value]
    return [*argv, *extra]


def install():
    """Wrap `megatron.training.arguments.parse_args` (idempotent); returns the module."""
    try:
        from megatron.training import arguments
    except ModuleNotFoundError as err:
        raise SystemExit(f"megatron.training is not importable ({err}). The launcher runs Megatron-LM's "
                         f"pretrain scripts: run one from a Megatron-LM checkout (its folder goes first on "
                         f"sys.path), or install megatron-core >= 0.17, whose wheel ships megatron.training") from err

    if getattr(arguments.parse_args, "_flash_overlap", False):
        return arguments
    original = arguments.parse_args

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = original(with_flash_overlap_args(extra_args_provider), ignore_unknown_args)
        return apply_flash_overlap_args(args)

    parse_args._flash_overlap = True
    parse_args._original = original
    arguments.parse_args = parse_args
    return arguments


def uninstall() -> None:
    """Undo `install()` (tests)."""
    from megatron.training import arguments

    arguments.parse_args = getattr(arguments.parse_args, "_original", arguments.parse_args)


def use_installed_helpers() -> Optional[str]:
    """Dataset helpers without `make`: Megatron's start-up runs `make` in `megatron/core/datasets` (needs
    pybind11 and python3-config) even where `helpers_cpp*.so` is already there. Compiled helpers: `make` is
    skipped. None (a fresh checkout): the installed megatron-core wheel's prebuilt `.so` is loaded in their
    place and `make` skipped. -> the `.so` in use, or None where there is none (Megatron then builds them)."""
    from megatron.core import datasets
    from megatron.core.datasets import utils

    found = glob.glob(os.path.join(os.path.dirname(datasets.__file__), "helpers_cpp*.so")) or _wheel_helpers()
    if not found:
        return None
    if not glob.glob(os.path.join(os.path.dirname(datasets.__file__), "helpers_cpp*.so")):
        name = "megatron.core.datasets.helpers_cpp"
        spec = importlib.util.spec_from_file_location(name, found[0])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = datasets.helpers_cpp = module
    utils.compile_helpers = lambda: None  # compiled (or loaded): nothing to build
    return found[0]


def _wheel_helpers() -> list[str]:
    """The installed megatron-core distribution's prebuilt helpers, found through its file list (a checkout
    earlier on sys.path shadows the package itself)."""
    try:
        files = importlib.metadata.files("megatron-core") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [str(f.locate()) for f in files if f.name.startswith("helpers_cpp") and f.name.endswith(".so")]


def launcher_options(argv: Sequence[str]) -> tuple[bool, Optional[int], list[str]]:
    """Leading launcher options -> (cpu, nproc_per_node or None, the rest: SCRIPT and its args)."""
    argv, cpu, nproc = list(argv), False, None
    while argv and argv[0].split("=", 1)[0] in ("--cpu", "--nproc-per-node"):
        head = argv.pop(0)
        if head == "--cpu":
            cpu = True
            continue
        value = head.split("=", 1)[1] if "=" in head else (argv.pop(0) if argv else "")
        if not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--nproc-per-node needs a positive integer, got {value!r}. {USAGE}")
        nproc = int(value)
    return cpu, nproc, argv


def torchrun(module: str, cpu: bool, nproc: int, rest: Sequence[str]) -> int:
    """Start `nproc` ranks of `python -m module [--cpu] rest...` under torchrun (standalone); -> exit code.
    SIGTERM to this process is passed to torchrun (which passes it to every rank): the server stops in order.
    A rank that dies leaves its own children (a server's HTTP frontends, Megatron's coordinator) to this
    launcher (a subreaper on Linux): they are killed when seen a second time, one poll later (a dead rank 0's
    frontend has answered its requests by then; a child a rank leaves as it exits in order has ended by itself);
    torchrun ends the job where the rank failed; none outlives the launcher. A rank that fails reports it
    (failures.py): the ranks still running a short grace later are killed (a stopped or hung one never ends on
    torchrun's SIGTERM), except after a SIGTERM to this process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *(["--cpu"] if cpu else []), *rest]
    watch = Watch()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **watch.env()}
    adopting = _become_subreaper()
    proc = subprocess.Popen(cmd, env=env)

    def stop(*_):  # the user's stop: torchrun stops its ranks, with its own grace
        watch.disarm()
        proc.send_signal(signal.SIGTERM)
    old, seen = signal.signal(signal.SIGTERM, stop), set()
    try:
        while True:
            try:
                return proc.wait(ORPHAN_POLL_S)
            except subprocess.TimeoutExpired:
                pass
            watch.poll(proc.pid)
            orphans = _adopted(proc.pid)
            left, seen = [p for p in orphans if p in seen], set(orphans)  # seen at the last poll too
            if left:  # a rank ended and left its children (a server's frontends, Megatron's coordinator)
                print(f"flashoverlap-launch: a rank ended leaving processes {left}: killing them",
                      file=sys.stderr, flush=True)
                _kill(left)
    finally:
        signal.signal(signal.SIGTERM, old)
        watch.close()
        _kill(_adopted(proc.pid) if adopting else [])


ORPHAN_POLL_S = 0.5  # how often the launcher looks for failure reports and processes a dead rank left behind


def _become_subreaper() -> bool:
    """Linux: a rank's children whose rank died are re-parented to this launcher instead of init (prctl
    PR_SET_CHILD_SUBREAPER), so it sees them and ends them; False where that is not available."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _adopted(torchrun_pid: int) -> list[int]:
    """This process's children other than torchrun: processes whose parent rank died (reaped where exited)."""
    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == torchrun_pid:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # fields: state, ppid, ...
            if fields[0] == "Z":
                _reap(int(name))
            else:
                out.append(int(name))
    return out


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _kill(pids: Sequence[int]) -> None:
    """SIGKILL: their owner is gone, and Megatron's coordinator ignores SIGTERM by design."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def prepare(prog: str, args: Sequence[str], cpu: bool) -> None:
    """Steps 1-4 for one rank: `sys.argv = [prog, *args (+ CPU defaults)]`, shims, helpers, parse_args."""
    sys.argv = [prog, *(cpu_argv(args) if cpu else args)]
    if cpu:
        from .. import cpu as cpu_shims

        if not cpu_shims.enable():
            raise SystemExit("--cpu was given but CUDA is available: the CPU shims are never applied on a GPU "
                             "machine; drop --cpu to train on the GPU")
    use_installed_helpers()
    install()
    from .. import sites  # imports Megatron: after the checkout's folder went first on sys.path

    sites.install()


def run_entry(module: str, prog: str, run: Callable[[], None], argv: Optional[Sequence[str]]) -> None:
    """The project's entries (pretrain_gpt, generate): `argv` = [--cpu] [--nproc-per-node N] <megatron args>;
    with N, torchrun starts N ranks of `python -m module`; without, this rank prepares (as `prog`) and runs."""
    cpu, nproc, rest = launcher_options(sys.argv[1:] if argv is None else argv)
    if nproc is not None:
        raise SystemExit(torchrun(module, cpu, nproc, rest))
    with reporting():  # a failure tells the launcher (failures.py)
        prepare(prog, rest, cpu)
        run()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`argv` = [--cpu] [--nproc-per-node N] script [megatron args]; runs the script as `__main__`."""
    cpu, nproc, rest = launcher_options(sys.argv[1:] if argv is None else argv)
    if not rest or rest[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    script = rest[0]
    if not os.path.isfile(script):
        raise SystemExit(f"{script}: no such file. {USAGE}  (SCRIPT is Megatron-LM's pretrain_gpt.py, "
                         f"e.g. path/to/Megatron-LM/pretrain_gpt.py)")
    if nproc is not None:
        raise SystemExit(torchrun("megatron_flashoverlap.launch", cpu, nproc, rest))
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # what `python script.py` does
    with reporting():  # a failure tells the launcher (failures.py)
        prepare(script, rest[1:], cpu)
        if "--flash-overlap" in rest and not _callable_spec_supported():
            raise SystemExit(LEGACY)
        runpy.run_path(script, run_name="__main__")


LEGACY = ("--flash-overlap needs Megatron-LM core_v0.19.0 or newer: older pretrain_gpt.py hands the --spec "
          "object to GPTModel unevaluated (it must be a ModuleSpec, ours is a function of the model config). "
          "Use a 0.19+ checkout, or build the model with megatron_flashoverlap.spec.layer_spec(...) in your "
          "own model provider")


def _callable_spec_supported() -> bool:
    """Megatron-LM 0.19 builds models from a GPTModelConfig that calls a callable --spec (GPTModelBuilder)."""
    try:
        from megatron.training.argument_utils import gpt_config_from_args  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
