"""The one plan object: what a layer site runs (the YAML's qkv / proj / fc1 / fc2 entries) and what one GEMM
operator call runs (an operator's `plan=`), and the FP8 recipe a plan may carry. Pure: no torch.

    OpPlan(algo, num_chunks, hop_chunks, keep_gathered, wire_dtype, decode_all_reduce, decode_step, fp8)
        algo               a site: auto (the chooser picks stock or flash per step kind and shape), flash,
                           flash_bidir (the ring both ways), slicing (the baseline), reference (the unfused path);
                           an operator call runs one of ALGOS (ops/registry.resolve refuses auto)
        num_chunks         slicing: its chunk count (required); the all-reduce operators' flash algos: sequence
                           chunks (None: their default); refused elsewhere (a YAML site: slicing only)
        hop_chunks         flash (or auto's flash): row sub-chunks per ring hop (None: one transfer per hop)
        keep_gathered      all_gather_matmul: keep AG(x) from forward for the weight gradient (memory for time)
        wire_dtype         what reduce-scatter partials travel in: "input" (stock's bytes) or "fp32"
        decode_all_reduce  matmul_all_reduce on decode-shaped x [1, b, k/P]: the all_reduce algo ("auto": the
                           chooser's; None: run `algo` on decode inputs too)
        decode_step        matmul_all_reduce: this call belongs to a decode-only step (one new token per sequence
                           in any layout, e.g. the dynamic engine's [n, 1, k/P]): the decode all-reduce whatever
                           x's shape (False: decode-shaped x [1, b, k/P] only)
        fp8                an Fp8Recipe: every GEMM slice of the TP operators in FP8 (ops/registry.py says
                           which operators read it; runtime/fp8.py the math), None: no FP8
    Fp8Recipe(format, recipe, margin, amax_history_len, amax_compute_algo, interval)
                           Megatron's --fp8-format, --fp8-recipe, --fp8-margin, --fp8-amax-history-len,
                           --fp8-amax-compute-algo, --fp8-interval (its defaults); format_of(role): e4m3, but e5m2
                           for "grad_output" under "hybrid"
Each is checked once when made, every error naming the fix; which operator reads which knob: ops/registry.KNOBS
(a knob an operator does not read is refused there, never ignored). The layer derives its operators' plans from
its site's (megatron/linear.py `_op_plans`); the YAML's words for a site are checked in config/__init__.py.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

ALGOS = ("flash", "flash_bidir", "slicing", "reference")  # what one TP operator call runs
SITE_ALGOS = ALGOS + ("auto",)  # a layer site's words (auto: the chooser's pick per call shape)
RENAMED = {"stock": "reference", "off": "reference"}  # old words for the unfused path
ALL_REDUCE_ALGOS = ("auto", "reference", "ring", "recursive_doubling", "hierarchical", "hierarchical_pipelined",
                    "hierarchical_hd")
WIRE_DTYPES = ("input", "fp32")  # the words of every reduce-scattering operator's wire_dtype=
FP8_FORMATS = ("e4m3", "hybrid")  # Megatron's --fp8-format words
FP8_RECIPES = ("tensorwise", "delayed")  # of Megatron's --fp8-recipe words, the ones our GEMMs run
AMAX_ALGOS = ("max", "most_recent")


def _positive_int_or_none(value, where: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{where} must be an integer >= 1 (e.g. 4), got {value!r}")


def _check_int(name: str, value, low: int, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Fp8Recipe: {name} must be an integer >= {low}, got {value!r}; set {flag} to one")


def check_wire(op: str, wire: str) -> None:
    """ValueError naming the accepted words, where an operator first sees its wire_dtype."""
    if wire not in WIRE_DTYPES:
        raise ValueError(f"{op}: wire_dtype={wire!r} is not one of {WIRE_DTYPES}; use 'input' (partials travel "
                         f"in the input dtype, stock's bytes) or 'fp32' (twice the bytes, one rounding)")


@dataclass(frozen=True)
class Fp8Recipe:
    """One FP8 recipe (module docstring), checked once when made; each error names the flag to change."""
    format: str = "e4m3"
    recipe: str = "tensorwise"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    interval: int = 1

    def __post_init__(self):
        if self.format not in FP8_FORMATS:
            raise ValueError(f"Fp8Recipe: format {self.format!r} is not one of {FP8_FORMATS}; set --fp8-format "
                             f"e4m3 (every tensor e4m3) or hybrid (gradients e5m2)")
        if self.recipe not in FP8_RECIPES:
            raise ValueError(f"Fp8Recipe: recipe {self.recipe!r} has no per-tensor FP8 GEMM here; set "
                             f"--fp8-recipe to one of {FP8_RECIPES}, or drop --flash-overlap for it")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"Fp8Recipe: amax_compute_algo {self.amax_compute_algo!r}: set "
                             f"--fp8-amax-compute-algo to one of {AMAX_ALGOS}")
        _check_int("margin", self.margin, 0, "--fp8-margin")
        _check_int("amax_history_len", self.amax_history_len, 1, "--fp8-amax-history-len")
        _check_int("interval", self.interval, 1, "--fp8-interval")

    def format_of(self, role: str) -> str:
        """The format tensors of `role` are cast to: e5m2 for gradients under "hybrid", else e4m3."""
        return "e5m2" if self.format == "hybrid" and role == "grad_output" else "e4m3"


@dataclass(frozen=True)
class OpPlan:
    """What a site or one GEMM operator call runs (module docstring), checked once when made."""
    algo: str = "flash"
    num_chunks: int | None = None
    hop_chunks: int | None = None
    keep_gathered: bool = False
    wire_dtype: str = "input"
    decode_all_reduce: str | None = "auto"
    decode_step: bool = False
    fp8: Fp8Recipe | None = None

    def __post_init__(self):
        self._check_algo()
        _positive_int_or_none(self.num_chunks, "num_chunks")
        if self.algo == "slicing" and self.num_chunks is None:
            raise ValueError("algo 'slicing' needs num_chunks >= 1 (e.g. num_chunks: 4)")
        _positive_int_or_none(self.hop_chunks, "hop_chunks")
        if self.hop_chunks is not None and self.algo not in ("flash", "auto"):
            raise ValueError(f"hop_chunks is a knob of algo 'flash' (and auto's flash) only; remove it for algo "
                             f"{self.algo!r}")
        if not isinstance(self.keep_gathered, bool):
            raise ValueError(f"keep_gathered must be true or false, got {self.keep_gathered!r}")
        check_wire("OpPlan", self.wire_dtype)
        if self.decode_all_reduce is not None and self.decode_all_reduce not in ALL_REDUCE_ALGOS:
            raise ValueError(f"decode_all_reduce {self.decode_all_reduce!r}: choose one of {ALL_REDUCE_ALGOS} "
                             f"or None (decode inputs run `algo` too)")
        if not isinstance(self.decode_step, bool):
            raise ValueError(f"decode_step must be True or False, got {self.decode_step!r}")
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Recipe):
            raise ValueError(f"fp8 must be an Fp8Recipe (megatron_flashoverlap.Fp8Recipe) or None, got "
                             f"{type(self.fp8).__name__}")
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def _check_algo(self) -> None:
        if self.algo in ("off", False):  # YAML 1.1 reads a bare `off` as false
            raise ValueError("algo 'off' is now called 'reference' (the unfused path: Megatron's own forward); "
                             "write algo: reference")
        if self.algo not in SITE_ALGOS:
            hint = f" ({self.algo!r} is now called {RENAMED[self.algo]!r})" if self.algo in RENAMED else ""
            raise ValueError(f"unknown algo {self.algo!r}{hint}; choose one of {SITE_ALGOS}")

    def __hash__(self) -> int:  # hashed once: the per-call plan caches (resolve, sized) look plans up by it
        return self._hash

    @property
    def is_reference(self) -> bool:
        """The unfused path: a layer runs Megatron's own forward (under FP8 our FP8 reference)."""
        return self.algo == "reference"

    @property
    def bidirectional(self) -> bool:
        """The ring runs both ways (half of each shard each way)."""
        return self.algo == "flash_bidir"

    @property
    def hops(self) -> int:
        """Row sub-chunks per hop of the ring that runs (1 where the plan leaves it open or has no ring)."""
        return self.hop_chunks or 1
