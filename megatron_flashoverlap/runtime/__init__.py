"""The runtime: one executor over torch.distributed P2P, its data-side handlers, the pipeline API on top
(an operator writes only its compute closure), shared numerics, and the context that owns buffers."""
from .alltoall import consume_all_to_all, produce_all_to_all
from .context import OverlapContext, TraceEvent, default_context, shared_context
from .executor import execute
from .transport import (PeerError, PeerLostError, PeerTimeoutError, first_peer_error, link, names_call,
                        names_operator, transport_kind, wait_collective)
from .fp8 import DelayedScales, Fp8Recipe
from .group import all_gather_into, global_rank, group_info, reduce_scatter_into
from .numerics import (WIRE_DTYPES, acc_dtype, check_wire, partial_linear, partial_producer, rows_writer, sums, wgrad,
                       wire_dtype)
from .options import Producer, Ring, Sums
from .pipeline import Pass, exchange, gather, gather_and_consume, produce_and_scatter, scatter, tail, walk

__all__ = ["DelayedScales", "Fp8Recipe", "OverlapContext", "Pass", "PeerError", "PeerLostError", "PeerTimeoutError", "Producer", "Ring", "Sums",
           "TraceEvent", "WIRE_DTYPES",
           "acc_dtype", "all_gather_into", "check_wire", "first_peer_error", "link", "names_call", "names_operator", "partial_linear", "partial_producer", "rows_writer",
           "transport_kind", "wait_collective", "wire_dtype",
           "consume_all_to_all", "default_context", "exchange", "execute", "gather", "gather_and_consume",
           "global_rank", "group_info", "produce_all_to_all", "produce_and_scatter", "reduce_scatter_into",
           "scatter", "shared_context", "sums", "tail", "walk", "wgrad"]
