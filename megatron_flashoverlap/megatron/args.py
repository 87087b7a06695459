"""The `--flash-overlap` flags for Megatron-LM's pretrain scripts, shared by the launcher and the patch.

    with_flash_overlap_args(provider) -> provider   an `extra_args_provider` (parser -> parser) that adds
                                                    our flags, then calls the script's own provider
    apply_flash_overlap_args(args) -> args          if `--flash-overlap`: check the flags, select our spec
                                                    (`--spec megatron_flashoverlap.spec flashoverlap_layer_spec`)
                                                    and load + activate the per-site config

`args` keeps plain values only (a bool, a path, the spec pair): Megatron saves `args` in every checkpoint,
so no object of ours ends up there.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, Optional

SPEC = ["megatron_flashoverlap.spec", "flashoverlap_layer_spec"]
FLAG, CONFIG_FLAG = "--flash-overlap", "--flash-overlap-config"

Provider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def add_flash_overlap_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `flash-overlap` argument group (once: a second call is a no-op)."""
    if FLAG in parser._option_string_actions:  # launcher on a patched script: both add the group
        return parser
    group = parser.add_argument_group(title="flash-overlap (megatron-flashoverlap)")
    group.add_argument(FLAG, action="store_true",
                       help="Run the TP linears of the GPT layers with megatron-flashoverlap's decomposed, "
                            "tail-free comm/GEMM overlap (selects --spec " + " ".join(SPEC) + "). "
                            "Needs --sequence-parallel for the overlap; without it the layers run stock.")
    group.add_argument(CONFIG_FLAG, type=str, default=None, metavar="PATH",
                       help="Per-GEMM-site YAML (see configs/*.yaml: flash, slicing, stock); "
                            "default: $FLASHOVERLAP_CONFIG if set, else flash on every site. "
                            "Needs --flash-overlap.")
    return parser


def with_flash_overlap_args(provider: Optional[Provider] = None) -> Provider:
    """`extra_args_provider` for `parse_args` / `parse_and_validate_args`: ours, then `provider`."""
    def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = add_flash_overlap_args(parser)
        return provider(parser) if provider is not None else parser
    return extra_args_provider


def apply_flash_overlap_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check the flags; with `--flash-overlap`, set `args.spec` to ours and activate the config."""
    enabled = getattr(args, "flash_overlap", False)
    path = getattr(args, "flash_overlap_config", None)
    if not enabled:
        if path is not None:
            raise ValueError(f"{CONFIG_FLAG} {path} was given without {FLAG}; add {FLAG} to use it "
                             f"(or drop {CONFIG_FLAG} for a stock run)")
        return args
    _check_compatible(args)
    args.spec = list(SPEC)
    _log_once(f"> {FLAG}: --spec {' '.join(SPEC)}; per-site config: {activate_config(path)}")
    return args


_LOGGED: set = set()


def _log_once(line: str) -> None:
    """Rank 0 only (from $RANK: torch.distributed is not up at parse time); Megatron parses up to 3 times."""
    if line not in _LOGGED and int(os.environ.get("RANK", "0")) == 0:
        _LOGGED.add(line)
        print(line, flush=True)


def _check_compatible(args: argparse.Namespace) -> None:
    spec = getattr(args, "spec", None)
    if spec and list(spec) != SPEC:
        raise ValueError(f"{FLAG} selects its own layer spec ({' '.join(SPEC)}) but --spec {' '.join(spec)} "
                         f"was given; drop --spec (or drop {FLAG} to keep your spec)")
    if getattr(args, "tp_comm_overlap", False):
        raise ValueError(f"{FLAG} replaces --tp-comm-overlap (Transformer Engine userbuffers, which would "
                         f"still be initialized and then unused); drop --tp-comm-overlap")
    backend = getattr(args, "attention_backend", None)
    if backend is not None and getattr(backend, "name", str(backend)) == "local":
        raise ValueError(f"{FLAG} cannot be combined with --attention-backend local (Megatron then "
                         f"requires --spec local); use --attention-backend auto or unfused")


def activate_config(path: Optional[str]) -> str:
    """Load the per-site YAML at `path` (errors name the fix) and publish it to our spec through
    $FLASHOVERLAP_CONFIG (absolute path), which `flashoverlap_layer_spec` reads when Megatron calls it
    with its own model config. None: nothing to load; the spec uses $FLASHOVERLAP_CONFIG if set, else
    `flash` on every site. Returns where the spec's config comes from (for the log line)."""
    from ..config import load_config
    from .spec import ENV_CONFIG

    if path is None:
        return os.environ.get(ENV_CONFIG, "default (flash on every site)")
    if not os.path.isfile(path):
        raise ValueError(f"{CONFIG_FLAG} {path}: no such file (cwd {os.getcwd()}); pass the path of a "
                         f"YAML such as configs/flash.yaml from the megatron-flashoverlap checkout")
    load_config(path)  # fail here, at parse time, not when the model is built
    os.environ[ENV_CONFIG] = os.path.abspath(path)
    return os.environ[ENV_CONFIG]
