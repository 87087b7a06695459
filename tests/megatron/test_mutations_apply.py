"""Tier 3, in this process (no ranks): every mutation of tests/support/mutations.py applies and undoes itself.

Its proof (the tests it names fail under it) is a `--control` run, minutes each and not part of the suite; this
catches the helper rotting under a rename first (cost_model_fuses_nothing named a module alias that no longer
existed: its `--control` run stopped with a NameError before any test ran). In this tier because applying some
mutations imports megatron-core, which the pure tier does not."""
import pytest

from tests.support.mutations import MUTATIONS


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_applies_and_is_undone(name):
    undo = MUTATIONS[name].apply()
    assert undo, f"{name}: applied, but nothing to undo (it patched nothing)"
    for fn in reversed(undo):
        fn()
