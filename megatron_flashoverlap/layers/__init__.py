"""Megatron-Core drop-in layers (this package imports megatron)."""
from .linear import FlashColumnParallelLinear, FlashRowParallelLinear

__all__ = ["FlashColumnParallelLinear", "FlashRowParallelLinear"]
