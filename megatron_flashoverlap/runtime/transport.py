"""Transports: how a walk posts its point-to-point transfers and waits on them, chosen by the group's backend.

    transport_kind(backend, device_type) -> "stream" | "timed"   a pure function of the two names
    link(group, device) -> Link                                   the group's transport, built once and cached
    @names_operator                                               on an autograd Function: a PeerError raised in
                                                                  its forward / backward names it first
    names_call(label)(fn)                                         the same for a plain function (and a finish
                                                                  it hands back)
    first_peer_error(wait_s) -> PeerError | None                  the first one this process made, any thread
    wait_collective(works, group, device, timeout, label)         async collectives (references, baselines)

"stream" (NCCL, any CUDA backend, torch's "fake" backend): `work.wait()` without a timeout. On NCCL that
    only makes the current CUDA stream wait on NCCL's stream (an event): no host sync, so the host runs
    ahead of the GPU and a walk can be captured in a CUDA graph (a timed `wait(timeout)` would turn into a
    host loop polling completion). A dead peer surfaces through the process group's own timeout and
    watchdog (`init_process_group(timeout=...)`, TORCH_NCCL_ASYNC_ERROR_HANDLING), not OverlapContext.timeout.
    The fake backend (every transfer completes at once) stands in for NCCL when the host cost is timed.
"timed" (gloo, mpi and any other host-driven backend): `work.wait(limit)`, limit = the group's own timeout
    (read at each wait: `init_process_group(timeout=)`, `new_group(timeout=)`, Megatron's
    --distributed-timeout-minutes, a later `_set_pg_timeout`), or ctx.timeout where that is smaller: one
    deadline for our waits and stock's collectives. Past it: PeerTimeoutError naming the group, the peer's
    global rank and the step. A peer whose connection is gone, at post or at wait: PeerLostError naming the
    peer's global rank and the step (never reported as a timeout).

Posting off the compute thread (gloo, and any host-driven backend that posts directly): a step's posts
run on the group's communication thread (runtime/commthread.py, one FIFO per group: each peer's transfers
in program order), so the GEMM slice of the step overlaps the host work of posting it; `wait` first waits
(timed) for the post to have run, re-raising its PeerLostError in the compute thread, then on the works.

Posting: on gloo and fake, `batch_isend_irecv` is a plain loop of isend/irecv, so the link calls the
group's own send/recv (group ranks, none of the per-op argument checks); every other backend posts a
step with `batch_isend_irecv`, which coalesces where the backend can (NCCL: one group call per step).
"""
from __future__ import annotations

import functools
import threading
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from .commthread import Pending, comm_thread, threaded

HOST_DRIVEN = ("gloo", "mpi")  # the host moves the bytes: only a timed wait notices a dead peer
DIRECT_POSTING = ("gloo", "fake")  # batch_isend_irecv is a plain loop of isend / irecv on these
_LINKS: dict = {}
_MAX_LINKS = 256  # (group, device type) pairs cached; past that the cache starts over (it only saves time)


class PeerError(RuntimeError):
    """A transfer with a peer failed; the process group is unusable afterwards (restart the job). The first one
    made in a process is kept (`first_peer_error`)."""

    def __init__(self, *args):
        super().__init__(*args)
        if not _FIRST:
            _FIRST.append(self)
            _FIRST_SEEN.set()


class PeerTimeoutError(PeerError):
    """A peer did not complete a transfer within the context's timeout (timed transports only)."""


class PeerLostError(PeerError):
    """The connection to a peer is gone (it exited or left the process group), at post or at wait."""


def backend_for(backend: str, device_type: str) -> str:
    """The backend serving tensors of `device_type`: "cpu:gloo,cuda:nccl" -> "gloo" for "cpu"."""
    if ":" not in backend:
        return backend
    table = dict(part.split(":", 1) for part in backend.split(","))
    return table.get(device_type, backend)


def transport_kind(backend: str, device_type: str = "cpu") -> str:
    """ "stream" (ordered on the device, untimed) or "timed" (host wait with a deadline): module docstring."""
    name = backend_for(str(backend), device_type)
    if name == "fake":
        return "stream"
    if name in HOST_DRIVEN:
        return "timed"
    return "stream" if name == "nccl" or device_type == "cuda" else "timed"


class Link:
    """One group's transport for one device type. A step's works come back in the order of its ops:
    its sends, then its receives (one work for the whole step where the backend coalesces)."""

    def __init__(self, group, device_type: str):
        self.group = group
        self.pg = dist.group.WORLD if group is None else group
        self.backend = str(dist.get_backend(group))
        self.kind = transport_kind(self.backend, device_type)
        self.timed = self.kind == "timed"
        self.direct = backend_for(self.backend, device_type) in DIRECT_POSTING
        self.threaded = self.timed and self.direct  # gloo: posts run on the communication thread
        self.device = torch.device(device_type)
        self._global: dict[int, int] = {}

    def limit(self, timeout: timedelta | None) -> timedelta:
        """A timed wait's deadline: the group's own timeout, or `timeout` where that is smaller."""
        own = group_timeout(self.pg, self.device)
        return own if timeout is None or own <= timeout else timeout

    def global_rank(self, peer: int) -> int:
        g = self._global.get(peer)
        if g is None:
            g = self._global[peer] = peer if self.group is None else dist.get_global_rank(self.group, peer)
        return g

    def post(self, step: int, sends: Sequence, send_peers: Sequence[int], recvs: Sequence,
             recv_peers: Sequence[int]):
        """Post the sends (to group ranks send_peers) and receives of one step. -> its works (a Pending of
        them where the posts run on the communication thread: pass it to `wait` as it is)."""
        if self.threaded and threaded():
            for p in (*send_peers, *recv_peers):
                self.global_rank(p)  # cached here, so the thread's error messages only read the cache
            return comm_thread(self.pg).submit(lambda: self._post(step, sends, send_peers, recvs, recv_peers))
        return self._post(step, sends, send_peers, recvs, recv_peers)

    def _post(self, step, sends, send_peers, recvs, recv_peers) -> list:
        works: list = []
        try:
            if not self.direct:
                return self._batch(sends, send_peers, recvs, recv_peers)
            pg = self.pg
            for t, p in zip(sends, send_peers):
                works.append(pg.send([t], p, 0))
            for t, p in zip(recvs, recv_peers):
                works.append(pg.recv([t], p, 0))
        except RuntimeError as e:
            ops = _ops(send_peers, recv_peers)
            verb, peer = ops[len(works)] if self.direct else ("transfers", None)
            raise PeerLostError(f"step {step}: posting the {verb} {self._who(peer, ops)} failed: {_reason(e)}. "
                                f"{_RESTART}") from e
        return works

    def _batch(self, sends, send_peers, recvs, recv_peers) -> list:
        ops = [dist.P2POp(dist.isend, t, self.global_rank(p), self.group) for t, p in zip(sends, send_peers)]
        ops += [dist.P2POp(dist.irecv, t, self.global_rank(p), self.group) for t, p in zip(recvs, recv_peers)]
        return dist.batch_isend_irecv(ops)

    def wait(self, works: Sequence, where: str, ops: Sequence | None, timeout) -> None:
        """Wait for `works` (ops[k] = (verb, group peer) of works[k], or None: the whole group); timed: at most
        `limit(timeout)`."""
        if self.timed:
            timeout = self.limit(timeout)
        if isinstance(works, Pending):
            works = self._posted(works, where, ops, timeout)
        if not self.timed:
            for w in works:
                w.wait()
            return
        for k, w in enumerate(works):
            try:
                ok = w.wait(timeout)
            except RuntimeError as e:
                raise self._failed(e, where, _op(ops, k, len(works)), timeout, ops) from e
            if ok is False:
                raise self._timeout(where, _op(ops, k, len(works)), timeout, ops)

    def _posted(self, pending: Pending, where: str, ops, timeout) -> list:
        """The works of a step posted on the communication thread (its PeerLostError re-raised here)."""
        works = pending.result(timeout.total_seconds())
        if works is None:
            raise self._timeout(where, ("transfers", None), timeout, ops)
        return works

    def _who(self, peer, ops) -> str:
        if peer is not None:
            return f"with global rank {self.global_rank(peer)} (group rank {peer})"
        peers = sorted({p for _, p in ops}) if ops else list(range(dist.get_world_size(self.group)))
        return f"with global ranks {[self.global_rank(p) for p in peers]}"

    def _group(self) -> str:
        desc, name = getattr(self.pg, "group_desc", ""), getattr(self.pg, "group_name", "")
        return f"process group {desc or name!r}" + (f" ({name})" if desc and name and desc != name else "")

    def _failed(self, e: RuntimeError, where: str, op, timeout, ops) -> PeerError:
        if _is_timeout(e):
            return self._timeout(where, op, timeout, ops)
        verb, peer = op
        return PeerLostError(f"{where}: the {verb} {self._who(peer, ops)} failed while waiting (not a timeout): "
                             f"{_reason(e)}. {_RESTART}")

    def _timeout(self, where: str, op, timeout, ops) -> PeerTimeoutError:
        verb, peer = op
        return PeerTimeoutError(
            f"{where}: the {verb} {self._who(peer, ops)} in {self._group()} did not complete within {timeout}. "
            f"A peer died or stopped, or the ranks called different operators or shapes. {_RESTART} (the limit is "
            f"the group's own timeout, Megatron's --distributed-timeout-minutes, or the config's timeout_s where "
            f"smaller)")


def names_operator(cls):
    """Class decorator of an autograd Function: a PeerError from its forward or backward starts with
    "<Function>.forward: " (the type and traceback kept), so the error names the operator beside the step."""
    for pass_ in ("forward", "backward"):
        fn = cls.__dict__[pass_].__func__
        setattr(cls, pass_, staticmethod(_naming(fn, f"{cls.__name__}.{pass_}")))
    return cls


def _naming(fn, label: str):
    @functools.wraps(fn)
    def run(*args, **kw):
        try:
            return fn(*args, **kw)
        except PeerError as e:
            e.args = (f"{label}: {e.args[0] if e.args else ''}", *e.args[1:])
            raise
    return run


def names_call(label: str):
    """Function decorator: a PeerError raised in the function, or in the finish() it returns (a deferred
    last hop), starts with "<label>: ", as `names_operator` does for an autograd Function's passes."""
    def wrap(fn):
        named = _naming(fn, label)

        @functools.wraps(fn)
        def run(*args, **kw):
            out = named(*args, **kw)
            return _naming(out, label) if callable(out) else out
        return run
    return wrap


_RESTART = "The process group is unusable now: restart the job"
_FIRST: list = []  # the first PeerError made in this process (any thread)
_FIRST_SEEN = threading.Event()


def first_peer_error(wait_s: float = 0.0) -> PeerError | None:
    """The first PeerError this process made, from any thread; None if none within `wait_s`. Why: a timed wait
    that gives up makes gloo close the peer's connection, and a collective another thread (the compute thread
    beside the DP worker's ring) waits on over that connection then fails with gloo's "pair closure", which
    names no peer: this says which transfer failed first."""
    _FIRST_SEEN.wait(wait_s)
    return _FIRST[0] if _FIRST else None


def _ops(send_peers, recv_peers) -> list:
    return [("send", p) for p in send_peers] + [("receive", p) for p in recv_peers]


def _op(ops, k: int, n: int) -> tuple:
    """(verb, peer) of work k; the whole step where one work covers several ops (coalesced)."""
    if ops is None:
        return ("collective", None)
    return ops[k] if len(ops) == n else ("transfers", None)


def _is_timeout(e: RuntimeError) -> bool:
    """gloo says "Timed out waiting 2000ms for recv operation to complete"."""
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _reason(e: RuntimeError) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def group_timeout(pg, device: torch.device) -> timedelta:
    """The timeout `pg` was made with for tensors of `device` (torch's default where the backend hides it)."""
    try:
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def link(group, device) -> Link:
    """The cached Link of (group, device type); the default group keyed by its object (re-inits differ)."""
    key = (dist.group.WORLD if group is None else group, device.type)
    lk = _LINKS.get(key)
    if lk is None:
        if len(_LINKS) >= _MAX_LINKS:
            _LINKS.clear()
        lk = _LINKS[key] = Link(group, device.type)
    return lk


def wait_collective(works: Sequence, group, device, timeout, label: str) -> None:
    """Wait for async collectives (a reference's or a slicing baseline's) through the group's transport."""
    works = [w for w in works if w is not None]
    if works:
        link(group, device).wait(works, label, None, timeout)
