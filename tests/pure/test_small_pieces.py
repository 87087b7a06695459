"""Small pieces (STYLE.md 12): no package file over 400 lines, function length median <= 12, p90 <= 40, no
function with more than 8 parameters (a settings object is passed instead) but Megatron-mandated signatures.

Tier: pure (parses the source with `ast`; nothing is imported or run).
"""
from __future__ import annotations

import ast
import pathlib
import statistics

PKG = pathlib.Path(__file__).resolve().parents[2] / "megatron_flashoverlap"
MAX_FILE_LINES, MAX_MEDIAN, MAX_P90, MAX_PARAMS = 400, 12, 40, 8
# The only signatures allowed past MAX_PARAMS: those whose parameter list Megatron's contract fixes (its spec and
# module builders call them with these names). Name (Class.method) -> the most parameters allowed.
MEGATRON_SIGNATURES = {
    # core attention: Megatron builds it as DotProductAttention(config, layer_number, attn_mask_type, attention_type,
    # attention_dropout, softmax_scale, cp_comm_type, pg_collection) (8, megatron-core 0.16 and 0.19), plus the one
    # ModuleSpec param each of ours takes from the spec (the Ulysses a2a algo; the SDPA kernels; query split's
    # flash config)
    "UlyssesDotProductAttention.__init__": 9,
    "QuerySplitDotProductAttention.__init__": 9,
    "SdpaDotProductAttention.__init__": 9,
    # get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8,
    # moe_use_legacy_grouped_gemm, normalization, qk_l2_norm, use_kitchen, use_kitchen_attention,
    # kitchen_attention_backend) (11, megatron-core 0.16), copied as a drop-in, plus 5 keyword-only extras
    # (flash_config, sequence_parallel, context_parallel_size, and the model config's attention_backend and
    # transformer_impl: which core attention, as Megatron's inference tests set it on the config)
    "get_gpt_layer_flashoverlap_spec": 16,
}


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def function_lengths(src: str) -> list[int]:
    """Lines of every def (nested ones too), decorators excluded."""
    return [n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def parameter_counts(src: str) -> dict[str, int]:
    """Qualified name (Class.method, outer.inner) -> parameters of every def: positional and keyword-only,
    self/cls excluded (an autograd.Function's ctx counts: it is one more thing to pass)."""
    out: dict[str, int] = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                out[prefix + child.name] = len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)
    visit(ast.parse(src), "")
    return out


def test_no_function_takes_more_than_8_parameters():
    found = {f"{p.relative_to(PKG).as_posix()}:{name}": (name, n) for p in _sources()
             for name, n in parameter_counts(p.read_text()).items()}
    over = {k: n for k, (name, n) in found.items() if n > MEGATRON_SIGNATURES.get(name, MAX_PARAMS)}
    assert not over, f"functions over {MAX_PARAMS} parameters (pass a settings object): {over}"
    names = {name for name, _ in found.values()}
    stale = set(MEGATRON_SIGNATURES) - names
    assert not stale, f"allow-list entries not in the package: {stale}"


def test_the_parameter_counter_counts():
    src = ("def f(a, b=1, *args, c, **kw):\n    def g(self, x, /, y):\n        pass\n\n\n"
           "class C:\n    def m(self, a):\n        pass\n\n    @classmethod\n    def k(cls, a, b):\n        pass\n\n"
           "    @staticmethod\n    def forward(ctx, x):\n        pass\n")
    assert parameter_counts(src) == {"f": 3, "f.g": 2, "C.m": 1, "C.k": 2, "C.forward": 2}


def test_no_file_over_400_lines():
    big = {p.relative_to(PKG).as_posix(): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not big, f"files over {MAX_FILE_LINES} lines: {big}"


def test_functions_are_short():
    lengths = sorted(n for p in _sources() for n in function_lengths(p.read_text()))
    p90 = lengths[int(0.9 * (len(lengths) - 1))]
    assert statistics.median(lengths) <= MAX_MEDIAN and p90 <= MAX_P90, (statistics.median(lengths), p90)


def test_the_length_counter_counts():
    src = "def f():\n    x = 1\n    return x\n\n\nclass C:\n    def g(self):\n        def h():\n            pass\n"
    assert sorted(function_lengths(src)) == [2, 3, 3]
