"""The `--flash-overlap` flags for Megatron-LM's pretrain scripts, shared by the launcher and the patch.

    with_flash_overlap_args(provider) -> provider   an `extra_args_provider` (parser -> parser) that adds our
                                                    flags, calls the script's own provider, and makes the
                                                    parser apply them right after parsing: BEFORE Megatron's
                                                    validate_args (and --use-checkpoint-args) sees them
    apply_flash_overlap_args(args) -> args          if `--flash-overlap`: check the flags, select our spec
                                                    (`--spec megatron_flashoverlap.spec flashoverlap_layer`),
                                                    load the per-site YAML and activate it (config.activate),
                                                    and make pretrain()'s DDP ours (megatron/ddp/pretrain.install: the
                                                    fused DP reduce-scatter under --use-distributed-optimizer
                                                    --overlap-grad-reduce)
    stock_from_our_checkpoints()                    under --use-checkpoint-args (installed by the parser): a run
                                                    without `--flash-overlap` keeps Megatron's own layers when
                                                    the checkpoint's args.spec is ours, and says so

`args` keeps plain values only (a bool, an absolute path, the spec pair): Megatron saves `args` in every
checkpoint, so no object of ours ends up there, and the saved `args.spec` names a ModuleSpec that every
Megatron path rebuilds (0.19's GPTModelBuilder, the legacy gpt_builder, tools/checkpoint).
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import Callable, Optional

from ...config import ENV_VARS, active
from ...config.refusals import FLAG, OUR_SPECS, refuse
from ...runtime.once import LogOnce, print_rank0

SPEC = list(OUR_SPECS[0])  # the --spec value --flash-overlap selects
CONFIG_FLAG = "--flash-overlap-config"

Provider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def add_flash_overlap_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `flash-overlap` argument group (once: a second call is a no-op)."""
    if FLAG in parser._option_string_actions:  # launcher on a patched script: both add the group
        return parser
    group = parser.add_argument_group(title="flash-overlap (megatron-flashoverlap)")
    group.add_argument(FLAG, action="store_true",
                       help="Run the TP linears of the GPT layers with megatron-flashoverlap's decomposed, "
                            "tail-free comm/GEMM overlap (selects --spec " + " ".join(SPEC) + "). With TP or "
                            "CP > 1 on GPUs older than Blackwell, set CUDA_DEVICE_MAX_CONNECTIONS=1 in the "
                            "launch environment (Megatron requires it; it also keeps each ring step's P2P and "
                            "GEMM slice queued in the order issued). The core attention is stock's for the same "
                            "flags; --attention-backend flash|fused without Transformer Engine's spec runs "
                            "torch SDPA with that kernel. Not with --attention-backend local, "
                            "--tp-comm-overlap or another --spec.")
    group.add_argument(CONFIG_FLAG, type=str, default=None, metavar="PATH",
                       help="Per-layer YAML (see configs/*.yaml: flash, slicing, stock); a relative PATH is "
                            "relative to the working directory the script was started from. Default: "
                            f"${ENV_VARS['config_path']} if set, else auto on every layer (stock or flash, measured at "
                            f"the first training step). Needs --flash-overlap.")
    return parser


def with_flash_overlap_args(provider: Optional[Provider] = None) -> Provider:
    """`extra_args_provider` for `parse_args` / `parse_and_validate_args`: ours, then `provider`; the
    parser it returns applies our flags to what it parses (before Megatron validates it)."""
    def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = add_flash_overlap_args(parser)
        parser = provider(parser) if provider is not None else parser
        return _applying(parser)
    return extra_args_provider


def _applying(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` run apply_flash_overlap_args on its result. Megatron's parse_args calls
    parser.parse_args() / parse_known_args() (the former calls the latter) and only then validate_args."""
    if getattr(parser, "_flash_overlap_applying", False):
        return parser
    parse_known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        parsed, rest = parse_known(args, namespace)
        if getattr(parsed, "use_checkpoint_args", False):
            stock_from_our_checkpoints()  # before parse_and_validate_args loads the checkpoint's args
        return apply_flash_overlap_args(parsed), rest

    parser.parse_known_args = parse_known_args
    parser._flash_overlap_applying = True
    return parser


def apply_flash_overlap_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check the flags; with `--flash-overlap`, set `args.spec` to ours and activate the config.
    Idempotent (the launcher on a patched script applies twice)."""
    enabled = getattr(args, "flash_overlap", False)
    path = getattr(args, "flash_overlap_config", None)
    if not enabled:
        if path is not None:
            raise ValueError(f"{CONFIG_FLAG} {path} was given without {FLAG}; add {FLAG} to use it "
                             f"(or drop {CONFIG_FLAG} for a stock run)")
        return args
    refuse("parse", args, FLAG)  # config/refusals.py: --spec, --tp-comm-overlap, FP8/FP4, ...
    if path is not None:
        args.flash_overlap_config = os.path.abspath(path)  # the caller's working directory, now
    args.spec = list(SPEC)
    from ..ddp.pretrain import install, refuse_unfusable  # pretrain()'s DDP becomes ours (ddp/pretrain.py)
    install()
    _log_once(f"> {FLAG}: --spec {' '.join(SPEC)}; per-layer config: {activate_config(args.flash_overlap_config)}")
    refuse_unfusable(active().dp.fuse, getattr(args, "use_distributed_optimizer", False),
                     getattr(args, "overlap_grad_reduce", False))  # at parse time: before a minute of start-up
    return args


def stock_from_our_checkpoints() -> None:
    """Make Megatron's `load_args_from_checkpoint` (which `--use-checkpoint-args` calls, restoring `args.spec`
    with force) keep a run without FLAG stock: a spec of ours that came from the checkpoint is put back to what
    the command line said (None: Megatron's own layers; the parameters and checkpoint keys are the same) and
    rank 0 says so. Idempotent; a no-op without megatron.training (megatron-core 0.16's wheel)."""
    try:
        from megatron.training import checkpointing
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("megatron"):
            raise
        return
    load = checkpointing.load_args_from_checkpoint
    if getattr(load, "_flash_overlap", False):
        return

    @functools.wraps(load)
    def load_args_from_checkpoint(args, *rest, **kwargs):
        given = getattr(args, "spec", None)
        result = load(args, *rest, **kwargs)
        spec = getattr(args, "spec", None)
        if not getattr(args, "flash_overlap", False) and spec and tuple(spec) in OUR_SPECS and spec != given:
            args.spec = given
            _log_once(f"> --use-checkpoint-args: the checkpoint was saved with {FLAG} (--spec {' '.join(spec)}); "
                      f"this run has no {FLAG}, so it builds Megatron's own layers (the same parameters); add "
                      f"{FLAG} to run ours")
        return result

    load_args_from_checkpoint._flash_overlap = True
    checkpointing.load_args_from_checkpoint = load_args_from_checkpoint  # parse_and_validate_args imports it late


_log_once = LogOnce(print_rank0)  # rank 0 ($RANK: no process group at parse time); Megatron parses up to 3 times


def activate_config(path: Optional[str]) -> str:
    """Load the per-layer YAML at `path` (errors name the fix) and activate it in-process
    (`config.activate`), where the spec reads it when Megatron builds the model. None: nothing activated;
    the spec uses the environment's YAML if one is named, else the defaults. Returns where it comes from."""
    from ...config import activate, environment, load_config

    if path is None:
        activate(None)
        return environment().config_path or "default (auto on every layer: stock or flash, measured at the first training step)"
    if not os.path.isfile(path):
        raise ValueError(f"{CONFIG_FLAG} {path}: no such file (working directory {os.getcwd()}); pass the path "
                         f"of a YAML such as configs/flash.yaml from the megatron-flashoverlap checkout")
    activate(load_config(path))  # fails here, at parse time, not when the model is built
    return os.path.abspath(path)
