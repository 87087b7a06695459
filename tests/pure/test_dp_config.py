"""Tier: pure (no processes). The `dp:` config section: which TP linears of pretrain()'s DDP fuse
(megatron/ddp/pretrain.py), checked with the fix."""
import pytest

from megatron_flashoverlap import config


def test_dp_fuse_defaults_to_auto_and_reads_yaml():
    assert config.from_dict({}).dp.fuse == "auto"
    assert config.from_dict({"dp": {"fuse": "all"}}).dp.fuse == "all"
    assert config.from_dict({"dp": {"fuse": "none"}}).dp.fuse == "none"


@pytest.mark.parametrize("data,words", [({"dp": {"fuse": "some"}}, "choose one of"),
                                        ({"dp": {"bucket": 2}}, "valid keys")])
def test_bad_dp_section_names_the_fix(data, words):
    with pytest.raises(ValueError, match=words):
        config.from_dict(data)
