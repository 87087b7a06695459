"""Megatron's FP8 settings as the recipe our linears run (runtime/fp8.py), or None for a run without FP8.

    recipe_of(config) -> Fp8Recipe | None
        config.fp8          --fp8-format e4m3 | hybrid (None: no FP8)
        config.fp8_recipe   --fp8-recipe: tensorwise (Transformer Engine's Float8CurrentScaling: each tensor scaled
                            from its own amax as it is cast; Megatron passes it no margin, so neither do we);
                            the other recipes are refused before a layer is built (config/refusals.py)
What an FP8 layer runs: every GEMM of its operator (forward, dgrad, wgrad) as an FP8 torch._scaled_mm with fp32
accumulation and the activation dtype out (ops/tp_sp/functions.py); its "stock" is the same operator's FP8
reference (the collective, then one FP8 GEMM), never Megatron's forward, which would run without FP8 (Megatron's
local layers have none: FP8 is Transformer Engine's there).
"""
from __future__ import annotations

import enum

from ..runtime.fp8 import Fp8Recipe


def _word(value) -> str | None:
    return value.name if isinstance(value, enum.Enum) else value


def recipe_of(config) -> Fp8Recipe | None:
    """The recipe of Megatron's TransformerConfig (module docstring); None without --fp8-format."""
    fmt = _word(getattr(config, "fp8", None))
    if not fmt:
        return None
    return Fp8Recipe(format=fmt, recipe=_word(getattr(config, "fp8_recipe", None)) or "delayed")
