"""Tier: pure (no processes). The one registry: every word an operator accepts has its plain function,
the words are config's, the unfused path has one name, and force_reference wins over any choice."""
import pytest

import megatron_flashoverlap  # noqa: F401  (importing the package fills the tables)
from megatron_flashoverlap import config
from megatron_flashoverlap.ops import registry

TABLE_OF = {  # public operator -> the registry tables its algorithms run
    "all_gather_matmul": ("all_gather_matmul", "all_gather_matmul.backward"),
    "matmul_reduce_scatter": ("matmul_reduce_scatter", "matmul_reduce_scatter.backward"),
    "matmul_all_reduce": ("matmul_all_reduce",),
    "matmul_allreduce_dgrad": ("matmul_all_reduce",),
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
    assert registry.resolve(op, word, 2)[0] == word
    with registry.force_reference():
        assert registry.resolve(op, word, 2) == ("reference", 1)
        with registry.force_reference():
            pass
        assert registry.forced()  # nested blocks restore the outer state
    assert not registry.forced()


@pytest.mark.parametrize("op,old", [("all_reduce", "stock"), ("ulysses_attention", "stock"),
                                    ("ulysses_fused_attention", "stock"), ("all_gather_matmul", "off")])
def test_old_unfused_words_name_reference(op, old):
    with pytest.raises(ValueError, match="now called 'reference'"):
        registry.resolve(op, old)


def test_chunk_rules():
    assert registry.resolve("matmul_reduce_scatter", "slicing", 3) == ("slicing", 3)
    assert registry.resolve("matmul_all_reduce", "flash", None, default_chunks=2) == ("flash", 2)
    assert registry.resolve("matmul_all_reduce", "flash_bidir", 4, default_chunks=2) == ("flash_bidir", 4)
    for bad in (None, 0):
        with pytest.raises(ValueError, match="num_chunks >= 1"):
            registry.resolve("matmul_reduce_scatter", "slicing", bad)
    with pytest.raises(ValueError, match="num_chunks >= 1"):
        registry.resolve("matmul_all_reduce", "flash", 0, default_chunks=2)


def test_a_word_registered_twice_is_refused():
    with pytest.raises(ValueError, match="already has"):
        registry.register("all_reduce", "ring")(lambda *a: None)
