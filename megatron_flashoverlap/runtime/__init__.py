"""The runtime: one executor over torch.distributed P2P, the context that owns buffers and timeouts."""
from .context import OverlapContext, TraceEvent, default_context
from .executor import PeerTimeoutError, execute
from .group import all_gather_into, global_rank, group_info, reduce_scatter_into

__all__ = ["OverlapContext", "PeerTimeoutError", "TraceEvent", "all_gather_into", "default_context",
           "execute", "global_rank", "group_info", "reduce_scatter_into"]
