"""`--flash-overlap` under Megatron's pretrain(): the DDP it builds is ours, with the fused DP reduce-scatter.

    install()                       the DDP class pretrain() builds -> FlashDistributedDataParallel, under both
                                    names it is built by (idempotent; False where megatron.training is absent:
                                    megatron-core < 0.17)
    FlashDistributedDataParallel    Megatron's DistributedDataParallel built by linear.build_with_dp_overlap
                                    (the automatic choice, its buckets, 0.19's layout rewrite); `flash_dp_accepted`

Megatron 0.19 builds DDP on two paths: the config container's model builder (`training/models/dist_utils.py`
`_ddp_wrap`: `DP = DistributedDataParallel`, the layout precomputed when `DP is DistributedDataParallel`; the
path of its pretrain_gpt.py recipe and of our entry) and `get_model()` (`training.py`: `DP = DDP`, the layout
when `DP is DDP`). Both read a module-global name at call time: a subclass put under each keeps the layout
step, and every `isinstance(m, DistributedDataParallel)` in Megatron. Which TP linears fuse: the config's
`dp: {fuse: auto | all | none}` (auto: choice.py's cost model, seq x micro-batch from Megatron's args; all:
every one; none: stock DDP). Where the DDP config cannot fuse (no --use-distributed-optimizer,
no --overlap-grad-reduce, a DP group of 1) the chunk is built as stock and one log line says why and what to add;
except that `fuse: all` without the two flags is refused (`refuse_unfusable`, at parse time and here): a user
who asked for every linear fused gets an error naming the flags, not a stock run said in one line among
Megatron's start-up lines.
"""
from __future__ import annotations

import logging
import os

from megatron.core.distributed import DistributedDataParallel

from ...config import active
from ...config.refusals import refuse, unhonoured
from .wrap import _dp_groups, _linears, build_with_dp_overlap

log = logging.getLogger(__name__)


def refuse_unfusable(fuse: str, use_distributed_optimizer, overlap_grad_reduce) -> None:
    """`dp: {fuse: all}` without the flags it needs: ValueError naming them (module docstring)."""
    if fuse == "all":
        refuse("dp", None, "dp: {fuse: all} in the flash-overlap config", overlap_grad_reduce=overlap_grad_reduce,
               use_distributed_optimizer=use_distributed_optimizer)


def why_stock(ddp_config, ddp_kwargs, fuse: str = "auto") -> str | None:
    """Why this DDP chunk is built stock, or None when the fused reduce-scatter applies."""
    if fuse == "none":
        return "dp: {fuse: none} in the flash-overlap config"
    missing = unhonoured("dp", ddp_config)  # config/refusals.py, the dp rows: --use-distributed-optimizer, ...
    if missing:
        return missing
    if _dp_groups(ddp_kwargs)[1].size() < 2:
        return "the data-parallel group has size 1"
    return None


class FlashDistributedDataParallel(DistributedDataParallel):
    """Megatron's DDP whose TP linears (chosen by choice.py) reduce-scatter their wgrad inside the GEMM."""

    def __init__(self, config, ddp_config, module, **kwargs):
        fuse = active().dp.fuse
        refuse_unfusable(fuse, ddp_config.use_distributed_optimizer, ddp_config.overlap_grad_reduce)
        why = why_stock(ddp_config, kwargs, fuse)
        if why is not None:
            super().__init__(config, ddp_config, module, **kwargs)
            self.flash_dp_accepted = []
            _say(f"> --flash-overlap: stock DDP ({why})")
            return

        def build(**kw):
            super(FlashDistributedDataParallel, self).__init__(config, ddp_config, module, **kw)
            return self

        linears = _linears(module) if fuse == "all" else None  # None: the automatic choice (choice.py)
        _, self.flash_dp_accepted = build_with_dp_overlap(build, ddp_config, module, linears=linears,
                                                          **kwargs)
        _say(f"> --flash-overlap: DP reduce-scatter inside the wgrad GEMM of {len(self.flash_dp_accepted)} "
             f"weight(s) (the choice: logger {build_with_dp_overlap.__module__})")


def _say(line: str) -> None:
    """Rank 0 prints it (beside Megatron's own start-up lines) and the module's logger records it."""
    log.info("%s", line)
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def install() -> bool:
    """Put the subclass under training.py's DDP name (module docstring)."""
    try:
        from megatron.training import training
    except ImportError:  # megatron-core < 0.17: no megatron.training, no pretrain() to serve
        return False
    training.DDP = FlashDistributedDataParallel
    try:
        from megatron.training.models import dist_utils
    except ImportError:  # before the model builders (megatron-core 0.17, 0.18): get_model() only
        return True
    dist_utils.DistributedDataParallel = FlashDistributedDataParallel
    return True
