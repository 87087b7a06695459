"""Tier: pure (no processes). The one registry: every word an operator accepts has its plain function,
the words are config's, the unfused path has one name, and force_reference wins over any choice."""
import pytest

import megatron_flashoverlap  # noqa: F401  (importing the package fills the tables)
from megatron_flashoverlap import config
from megatron_flashoverlap.ops import registry
from megatron_flashoverlap.schedules import ALL_REDUCE_SCHEDULES

TABLE_OF = {  # public operator -> the registry tables its algorithms run
    "all_gather_matmul": ("all_gather_matmul", "all_gather_matmul.backward", "all_gather_matmul.fp8",
                          "all_gather_matmul.fp8.backward"),
    "matmul_reduce_scatter": ("matmul_reduce_scatter", "matmul_reduce_scatter.backward", "matmul_reduce_scatter.fp8",
                              "matmul_reduce_scatter.fp8.backward"),
    "matmul_all_reduce": ("matmul_all_reduce", "matmul_all_reduce.fp8"),
    "matmul_allreduce_dgrad": ("matmul_all_reduce", "matmul_all_reduce.fp8"),
    "all_reduce": ("all_reduce",),
    "query_split_attention": ("query_split_attention",),
    "ulysses_attention": ("ulysses.seq_to_heads", "ulysses.heads_to_seq"),
    "ulysses_fused_attention": ("ulysses_fused_attention",),
    "matmul_wgrad_reduce_scatter": ("matmul_wgrad_reduce_scatter",),
    "expert_all_to_all": ("expert_all_to_all",),
}


def test_every_public_operator_has_its_words():
    assert set(registry.ALLOWED) == set(TABLE_OF)
    assert registry.ALLOWED["all_gather_matmul"] is config.ALGOS  # the words are config's, not a copy
    assert registry.ALLOWED["all_reduce"] is config.ALL_REDUCE_ALGOS
    assert config.ALL_REDUCE_ALGOS == ("auto", "reference", *ALL_REDUCE_SCHEDULES)  # the words a user writes
    assert registry.ALLOWED["ulysses_attention"] is config.ULYSSES_ALGOS


@pytest.mark.parametrize("op", sorted(TABLE_OF))
def test_every_word_has_a_plain_function(op):
    words = set(registry.ALLOWED[op]) - {"auto"}  # all_reduce resolves "auto" to one of the others
    for table in TABLE_OF[op]:
        assert set(registry.TABLES[table]) == words, (op, table)
        assert all(callable(f) for f in registry.TABLES[table].values())


@pytest.mark.parametrize("op", sorted(TABLE_OF))
def test_forced_reference_wins(op):
    word = "auto" if op == "all_reduce" else "flash"
    assert registry.resolve_algo(op, word) == word
    gemm = op in registry.KNOBS  # the GEMM operators resolve an OpPlan
    chunks = 2 if op in registry.CHUNKED else None
    if gemm:
        assert registry.resolve(op, registry.OpPlan(word, num_chunks=chunks)).algo == word
    with registry.force_reference():
        assert registry.resolve_algo(op, word) == "reference"
        if gemm:
            forced = registry.resolve(op, registry.OpPlan(word, num_chunks=chunks, wire_dtype="fp32"))
            assert forced == registry.OpPlan("reference", wire_dtype="fp32")  # the ring knobs go, the wire dtype stays
        with registry.force_reference():
            pass
        assert registry.forced()  # nested blocks restore the outer state
    assert not registry.forced()


@pytest.mark.parametrize("op,old", [("all_reduce", "stock"), ("ulysses_attention", "stock"),
                                    ("ulysses_fused_attention", "stock"), ("all_gather_matmul", "off")])
def test_old_unfused_words_name_reference(op, old):
    with pytest.raises(ValueError, match="now called 'reference'"):
        registry.resolve_algo(op, old)
    if op in registry.KNOBS:
        with pytest.raises(ValueError, match="now called 'reference'"):
            registry.OpPlan(old)


def test_chunk_rules():
    assert registry.resolve("matmul_reduce_scatter", registry.OpPlan("slicing", num_chunks=3)).num_chunks == 3
    assert registry.resolve("matmul_all_reduce", registry.OpPlan("flash"), default_chunks=2).num_chunks == 2
    bidir = registry.OpPlan("flash_bidir", num_chunks=4)
    assert registry.resolve("matmul_all_reduce", bidir, default_chunks=2).num_chunks == 4
    with pytest.raises(ValueError, match="num_chunks >= 1"):
        registry.OpPlan("slicing")
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="num_chunks must be an integer >= 1"):
            registry.OpPlan("flash", num_chunks=bad)


@pytest.mark.parametrize("op,knobs", [
    ("matmul_reduce_scatter", {"keep_gathered": True}), ("matmul_all_reduce", {"hop_chunks": 2}),
    ("matmul_allreduce_dgrad", {"decode_all_reduce": None}), ("query_split_attention", {"hop_chunks": 2}),
    ("matmul_wgrad_reduce_scatter", {"keep_gathered": True}), ("all_gather_matmul", {"num_chunks": 2}),
    ("matmul_wgrad_reduce_scatter", {"num_chunks": 2})])
def test_a_knob_the_operator_does_not_read_is_refused(op, knobs):
    with pytest.raises(ValueError, match=f"{op}: .*(not a knob of this operator|knob of algo)"):
        registry.resolve(op, registry.OpPlan("flash", **knobs))


def test_the_shorthand_and_the_plan_agree_or_are_refused():
    assert registry.plan_of("all_gather_matmul", None, None) == registry.OpPlan("flash")
    ref = registry.plan_of("all_gather_matmul", "reference", None)
    assert ref is registry.plan_of("all_gather_matmul", "reference", None)  # the shorthand is made once
    p = registry.OpPlan("slicing", num_chunks=2)
    assert registry.plan_of("all_gather_matmul", "slicing", p) is p
    with pytest.raises(ValueError, match="disagree"):
        registry.plan_of("all_gather_matmul", "flash", p)
    with pytest.raises(ValueError, match="all_gather_matmul: algo 'slicing' needs num_chunks"):
        registry.plan_of("all_gather_matmul", "slicing", None)


def test_a_word_registered_twice_is_refused():
    with pytest.raises(ValueError, match="already has"):
        registry.register("all_reduce", "ring")(lambda *a: None)
