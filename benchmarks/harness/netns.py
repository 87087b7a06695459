"""Network namespaces with a shaped loopback: the emulated interconnect of the benchmarks.

    with shaped_namespace("1gbit", burst="512kb") as ns:   # makes flashoverlap-<pid>-<n>, lo up, tbf on lo
        ns.run(["torchrun", "--nproc-per-node", "2", ...])  # = ip netns exec <name> torchrun ...
        ns.tc("qdisc", "show", "dev", "lo")                 # any tc / ip command inside the namespace
    # deleted on exit: normal, exception, SIGINT / SIGTERM (turned into exceptions), interpreter exit

Ranks inside talk over the namespace's own 127.0.0.0/8 only; nothing outside is reachable. This kernel
has tbf and htb (+ u32 filters) but no netem: rates can be shaped, delay cannot. On lo both directions
share one queue, so tbf `rate` is the sum of both directions (1gbit ~ 60 MiB/s each way for a ring of
two ranks). Keep `burst` <= 512kb: a larger bucket lets the first MBs after idle pass at memory speed.
A two-level topology uses `shaped_namespace(None)` (lo up, no qdisc), adds addresses with
`ns.add_address`, and builds its own htb tree + u32 filters with `ns.tc(...)`.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from typing import Iterator, Sequence

_LIVE: set[str] = set()
_COUNTER = itertools.count()
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(rate: str) -> float:
    """tc rate string -> bits per second ("1gbit" -> 1e9). Only the *bit units tc documents."""
    r = rate.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if r.endswith(unit):
            try:
                return float(r[: -len(unit)]) * _UNITS[unit]
            except ValueError:
                break
    raise ValueError(f"rate {rate!r}: write a number and a unit among {sorted(_UNITS)}, e.g. '1gbit'")


def parse_bytes(size: str) -> float:
    """tc size string -> bytes ("512kb" -> 524288; tc's k/kb = 1024 bytes, m/mb = 1024**2, b = 1)."""
    units = {"kb": 1024, "k": 1024, "mb": 1024 ** 2, "m": 1024 ** 2, "gb": 1024 ** 3, "g": 1024 ** 3, "b": 1}
    s = size.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit) and s[: -len(unit)].replace(".", "", 1).isdigit():
            return float(s[: -len(unit)]) * units[unit]
    if s.isdigit():
        return float(s)
    raise ValueError(f"size {size!r}: write a number and a unit among b, kb, mb, gb, e.g. '512kb'")


def why_not_shaped() -> str | None:
    """None when namespaces + tc can be used here, else the reason (not root, tool missing)."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run as root, or pass --unshaped for a labelled unshaped run)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; install iproute2 or pass --unshaped"
    return None


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=60)


class Namespace:
    """A live network namespace; every helper runs inside it."""

    def __init__(self, name: str):
        self.name = name

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """The argv that runs `argv` inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run inside the namespace (kwargs go to subprocess.run)."""
        return subprocess.run(self.exec_argv(argv), **kwargs)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.exec_argv(argv), **kwargs)

    def ip(self, *args: str) -> str:
        return _sh(["ip", "-n", self.name, *args]).stdout

    def tc(self, *args: str) -> str:
        return _sh(["tc", "-n", self.name, *args]).stdout

    def add_address(self, cidr: str, dev: str = "lo") -> None:
        """One more address (e.g. "127.0.1.1/32") on `dev`: a 'node' of a two-level topology."""
        self.ip("addr", "add", cidr, "dev", dev)

    def shape_lo(self, rate: str, burst: str = "512kb", latency: str = "100ms") -> None:
        """Replace lo's root qdisc by tbf(rate, burst, latency)."""
        parse_rate(rate)
        if parse_bytes(burst) <= 65536 + 1024:
            raise ValueError(f"burst {burst!r} must exceed lo's 64 KiB MTU (+ headers) or full-size packets are "
                             f"dropped and the ranks hang; use e.g. '256kb' or '512kb'")
        self.tc("qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, "burst", burst, "latency", latency)

    def qdisc(self) -> str:
        return self.tc("qdisc", "show", "dev", "lo").strip()


def _create(prefix: str) -> Namespace:
    name = f"{prefix}-{os.getpid()}-{next(_COUNTER)}"
    _sh(["ip", "netns", "add", name])
    _LIVE.add(name)
    ns = Namespace(name)
    ns.ip("link", "set", "lo", "up")
    return ns


def delete(name: str) -> None:
    """Delete a namespace made here (idempotent)."""
    if name in _LIVE:
        _sh(["ip", "netns", "del", name], check=False)
        _LIVE.discard(name)


@atexit.register
def _delete_all() -> None:
    for name in list(_LIVE):
        delete(name)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP raise KeyboardInterrupt (like SIGINT) so `finally` blocks delete the namespace."""
    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, _raise_interrupt)
        except ValueError:  # not the main thread: atexit still deletes
            pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def shaped_namespace(rate: str | None, burst: str = "512kb", latency: str = "100ms",
                     prefix: str = "flashoverlap") -> Iterator[Namespace]:
    """A fresh namespace with lo up and, when `rate` is given, tbf on lo; always deleted afterwards."""
    reason = why_not_shaped()
    if reason:
        raise PermissionError(reason)
    with _signals_raise():
        ns = _create(prefix)
        try:
            if rate is not None:
                ns.shape_lo(rate, burst, latency)
            yield ns
        finally:
            delete(ns.name)
