"""Run a Megatron-LM pretrain script with the `--flash-overlap` flag, unmodified.

    python -m megatron_flashoverlap.launch pretrain_gpt.py <megatron args> --flash-overlap \
        [--flash-overlap-config configs/flash.yaml]
    torchrun --nproc-per-node 8 -m megatron_flashoverlap.launch pretrain_gpt.py ...   (same, per rank)

Megatron-LM's `pretrain_gpt.py` hard-codes its `extra_args_provider`, so the launcher wraps the one
function every parse goes through, `megatron.training.arguments.parse_args` (which
`parse_and_validate_args` calls by module-global name):

    parse_args(provider, ...)  ->  parse_args(with_flash_overlap_args(provider), ...)
                                   then apply_flash_overlap_args(args): --spec megatron_flashoverlap.spec
                                   flashoverlap_layer_spec, per-site config loaded and activated

then runs the script as `__main__` (runpy), with `sys.argv` and `sys.path[0]` as `python script.py` would
set them: the script's folder first, so a Megatron-LM checkout's own `megatron/` package is the one wrapped.
`patches/` holds the same two calls as a patch to `pretrain_gpt.py`, for users who prefer patching.
"""
from __future__ import annotations

import functools
import os
import runpy
import sys
from typing import Optional, Sequence

from .args import apply_flash_overlap_args, with_flash_overlap_args

USAGE = ("usage: python -m megatron_flashoverlap.launch SCRIPT.py [megatron args] --flash-overlap "
         "[--flash-overlap-config PATH]")


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


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`argv` = [script, *megatron args]; runs the script as `__main__` with our flags understood."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"{script}: no such file. {USAGE}  (SCRIPT is Megatron-LM's pretrain_gpt.py, "
                         f"e.g. path/to/Megatron-LM/pretrain_gpt.py)")
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # what `python script.py` does
    install()
    if "--flash-overlap" in argv and not _callable_spec_supported():
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
