"""Tier: pure (no processes). The `moe:` config section: the EP exchange's algorithm, checked with the fix."""
import pytest

from megatron_flashoverlap import config


def test_moe_algo_defaults_to_auto_and_reads_yaml():
    assert config.from_dict({}).moe.algo == "auto"
    assert config.from_dict({"moe": {"algo": "reference"}}).moe.algo == "reference"


@pytest.mark.parametrize("data,words", [({"moe": {"algo": "deepep"}}, "choose one of"),
                                        ({"moe": {"chunks": 2}}, "valid keys")])
def test_bad_moe_section_names_the_fix(data, words):
    with pytest.raises(ValueError, match=words):
        config.from_dict(data)


def test_moe_words_are_the_registry_words():
    from megatron_flashoverlap.ops import registry

    assert registry.ALLOWED["expert_all_to_all"] is config.MOE_ALGOS
