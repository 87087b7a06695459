"""Tier 1 (no processes): the Megatron-LM unit-test plugin (tests/support/megatron_lm/megatron_lm_unit_tests.py)
imports a test file's Megatron modules before its Transformer Engine stand-in, and the stand-in lives only while
the test file imports (so no Megatron module imported later sees a transformer_engine)."""
import sys
import textwrap

import pytest

from tests.support.megatron_lm.megatron_lm_unit_tests import _no_fp8_transformer_engine, imported_modules

TEST_FILE = '''
import os
import megatron.core.parallel_state
from transformer_engine.pytorch.fp8 import check_fp8_support
from megatron.core.utils import is_fa_min_version, is_te_min_version
from tests.unit_tests.test_utilities import Utils
from . import sibling
try:
    from megatron.core.ssm.mamba_mixer import MambaMixer
except ImportError:
    MambaMixer = None

def test_x():
    from megatron.training import initialize
'''


def test_a_test_files_own_imports_are_found(tmp_path):
    path = tmp_path / "test_file.py"
    path.write_text(textwrap.dedent(TEST_FILE))
    assert imported_modules(path) == [
        "megatron.core.parallel_state",
        "megatron.core.utils", "megatron.core.utils.is_fa_min_version", "megatron.core.utils.is_te_min_version",
        "tests.unit_tests.test_utilities", "tests.unit_tests.test_utilities.Utils",
        "megatron.core.ssm.mamba_mixer", "megatron.core.ssm.mamba_mixer.MambaMixer"]


@pytest.mark.skipif("transformer_engine" in sys.modules, reason="a real Transformer Engine is imported")
def test_the_transformer_engine_stand_in_lives_only_inside_the_block():
    with _no_fp8_transformer_engine():
        from transformer_engine.pytorch.fp8 import check_fp8_support

        assert check_fp8_support()[0] is False
    assert not any(name.startswith("transformer_engine") for name in sys.modules)


def test_an_imported_transformer_engine_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", object())
    with pytest.raises(RuntimeError, match="already imported"):
        with _no_fp8_transformer_engine():
            pass
    assert sys.modules["transformer_engine"] is not None
