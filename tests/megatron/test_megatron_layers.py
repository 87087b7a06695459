"""Tier 3 (Megatron on gloo): our linears beside Megatron's stock ones, and the spec/CPU-shim plumbing.

Bodies in tests/megatron/mp_megatron_layers.py. Tolerances: forward outputs and input grads exact at P=2 (each
output element is the same dot product, and a 2-term sum does not depend on order); weight grads 1e-5
relative (summed slice by slice in fp32).
"""
import pytest

CONTRACT = "tests.megatron.mp_megatron_layers:contract"


@pytest.mark.parametrize("kind, sp, skip_bias_add, site", [
    ("column", True, False, "qkv"), ("column", True, True, "fc1"), ("row", True, True, "proj"),
    ("row", True, False, "fc2"), ("column", False, True, "fc1"), ("row", False, True, "fc2"),
    ("column", True, False, None)])
def test_layer_is_a_drop_in(pools, kind, sp, skip_bias_add, site):
    for res in pools(2).run(CONTRACT, kind, sp, skip_bias_add, site, timeout=300):
        assert res["params"] and res["values"], "same parameter names/shapes/TP attributes and init"
        assert res["attrs"], "every attribute of the stock layer, with the same value"
        assert res["accepts"] and res["sharded"]
        assert res["backward_dw"] == (None, None)  # ours has it in every version (0.16 stock row lacks it)
        assert res["shapes"][0] == res["shapes"][1]
        assert res["bias_is_param"] == (skip_bias_add, skip_bias_add)  # (output, bias) contract
        assert res["y_err"] == 0.0 and res["dx_err"] == 0.0
        assert res["grad_rel"] <= 1e-5


AUTO_CASES = [("column", True, False, "qkv"), ("row", True, True, "proj"), ("column", False, True, "fc1"),
              ("row", False, True, "fc2")]


@pytest.mark.parametrize("kind, sp, skip_bias_add, site", AUTO_CASES)
@pytest.mark.parametrize("tier", ["measured", "no budget", "pinned flash"])
def test_an_auto_layer_trains_as_its_choice_and_every_rank_takes_it(pools, kind, sp, skip_bias_add, site, tier):
    """algo auto (megatron/train_choice.py): the first training call decides <site>/train/<bucket> (stock,
    flash, or under SP flash with 2 sub-chunks per hop: forward + backward timed in paired rounds on the real
    group) and every rank holds the same pick; with no budget nothing is measured and the layer is Megatron's
    own forward (exact to stock); a pinned flash runs ours (the layer contract's tolerances)."""
    word = f"{site}/train/{tm_tokens(kind, sp)}"
    flash = {"default": {"algo": "auto"}, "choices": {
        "measured": {}, "no budget": {"budget_s": 0}, "pinned flash": {"pinned": {word: "flash"}}}[tier]}
    results = pools(2).run(CONTRACT, kind, sp, skip_bias_add, site, flash, timeout=300)
    assert results[0]["decided"] == results[1]["decided"] and word in results[0]["decided"], results[0]["decided"]
    pick, source = results[0]["decided"][word]
    assert source == {"measured": "measured", "no budget": "model", "pinned flash": "pinned"}[tier]
    assert pick in (("reference", "flash", "flash_c2") if sp else ("reference", "flash"))
    assert (tier != "no budget" or pick == "reference") and (tier != "pinned flash" or pick == "flash")
    assert results[0]["ran_hop_chunks"] == {"reference": [], "flash": [1], "flash_c2": [2]}[pick]
    for res in results:
        assert res["y_err"] == 0.0 and res["dx_err"] == 0.0
        assert res["grad_rel"] <= (0.0 if pick == "reference" else 1e-5)


@pytest.mark.parametrize("kind, sp, skip_bias_add, site", [AUTO_CASES[0], AUTO_CASES[2]])
def test_a_pinned_flash_c2_runs_two_sub_chunks_per_hop_and_only_under_sp(pools, kind, sp, skip_bias_add, site):
    """A choice file's flash_c2 (megatron/train_choice.py): under SP the layer runs flash with hop_chunks 2 (the
    layer contract's tolerances); without SP, where no hop can be cut, it is refused naming the candidates."""
    word = f"{site}/train/{tm_tokens(kind, sp)}"
    flash = {"default": {"algo": "auto"}, "choices": {"pinned": {word: "flash_c2"}}}
    if not sp:
        with pytest.raises(Exception, match="flash_c2 is not a candidate of this layer"):
            pools(2).run(CONTRACT, kind, sp, skip_bias_add, site, flash, timeout=300)
        return
    results = pools(2).run(CONTRACT, kind, sp, skip_bias_add, site, flash, timeout=300)
    assert results[0]["decided"][word] == results[1]["decided"][word] == ("flash_c2", "pinned")
    assert results[0]["ran_hop_chunks"] == results[1]["ran_hop_chunks"] == [2]
    for res in results:
        assert res["y_err"] == 0.0 and res["dx_err"] == 0.0 and res["grad_rel"] <= 1e-5


def test_a_training_choice_answers_only_its_own_operator():
    """One config's chooser (one process, two models): the same site, input and weight shapes and group, with
    and without SP, are two keys; a pick measured on one never answers the other, whose candidates differ
    (flash_c2 exists only under SP: the no-SP layer refused it and the run stopped)."""
    import torch

    from megatron_flashoverlap import config
    from megatron_flashoverlap.megatron.train_choice import train_key
    from megatron_flashoverlap.ops import matmul_reduce_scatter
    from megatron_flashoverlap.ops.tp_nosp.autograd import matmul_all_reduce
    from megatron_flashoverlap.plan.chooser import Choice, chooser_of

    x, w = torch.empty(32, 1, 64), torch.empty(64, 64)
    sp = train_key("proj", matmul_reduce_scatter, x, w, "2 ranks", (0, 1))
    nosp = train_key("proj", matmul_all_reduce, x, w, "2 ranks", (0, 1))
    assert sp.word == nosp.word == "proj/train/32" and sp != nosp
    chooser = chooser_of(config.from_dict({"default": {"algo": "auto"}}))
    chooser._keep(sp, Choice("flash_c2", "measured", "measured on the SP layer"))
    assert chooser.answer(sp).pick == "flash_c2"
    assert chooser.answer(nosp) is None  # measured afresh on its own operator


def tm_tokens(kind, sp):
    """The bucket of the layer's input tokens in the contract's run (s * b = SEQ * 2, or SEQ / P * 2 for a
    column's SP shard), rounded up to a power of two."""
    from megatron_flashoverlap.megatron import models as tm

    tokens = (tm.SEQ // 2 if (sp and kind == "column") else tm.SEQ) * 2
    return 1 << (tokens - 1).bit_length()


def _linear_configs(spec):
    from megatron_flashoverlap.megatron.spec import submodules_of

    attention, mlp = submodules_of(spec.submodules.self_attention), submodules_of(spec.submodules.mlp)
    return [m.params["flash_config"] for m in (attention.linear_qkv, attention.linear_proj, mlp.linear_fc1,
                                               mlp.linear_fc2)]


def test_spec_reads_the_active_config_else_the_env_file(clean_config, monkeypatch, tmp_path):
    """In-process (no processes): what flashoverlap_layer_spec hands its linears; Megatron's config is read
    for Megatron's fields only (a flash_* attribute on it changes nothing)."""
    from types import SimpleNamespace

    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    fc = clean_config
    megatron_cfg = SimpleNamespace(flash_overlap_config="configs/slicing.yaml", flash_query_split=True, num_layers=2,
                                   pipeline_model_parallel_size=1)  # the block spec reads the layer count
    assert _linear_configs(flashoverlap_layer_spec(megatron_cfg)) == [fc.FlashOverlapConfig()] * 4
    monkeypatch.setenv("FLASHOVERLAP_CONFIG", "configs/slicing.yaml")
    assert {c.plan("fc2").algo for c in _linear_configs(flashoverlap_layer_spec(megatron_cfg))} == {"slicing"}
    mine = fc.uniform("flash_bidir")
    fc.activate(mine)
    assert all(c is mine for c in _linear_configs(flashoverlap_layer_spec(megatron_cfg)))
    fc.activate(None)
    bad = tmp_path / "bad.yaml"
    bad.write_text("qkv: {algo: warp}\n")
    monkeypatch.setenv("FLASHOVERLAP_CONFIG", str(bad))
    with pytest.raises(ValueError, match="bad.yaml: qkv: unknown algo 'warp'"):
        flashoverlap_layer_spec(megatron_cfg)


@pytest.mark.parametrize("kw, words", [
    ({"moe_use_legacy_grouped_gemm": True}, ["legacy GroupedMLP"]),  # MoE itself builds: tests/megatron/test_moe_gpt.py
    ({"multi_latent_attention": True}, ["multi-latent"]),
    ({"use_kitchen": True}, ["Kitchen", "get_gpt_layer_local_spec(use_kitchen=True)"]),
    ({"use_kitchen_attention": True}, ["Kitchen"]),
], ids=["legacy_grouped_gemm", "mla", "kitchen", "kitchen_attention"])
def test_signature_spec_refuses_what_it_does_not_build(clean_config, kw, words):
    from megatron_flashoverlap.spec import get_gpt_layer_flashoverlap_spec

    with pytest.raises(ValueError) as err:
        get_gpt_layer_flashoverlap_spec(**kw)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_spec_refuses_moe_and_mla_and_query_split_without_sp(clean_config):
    from types import SimpleNamespace

    from megatron_flashoverlap.spec import flashoverlap_layer_spec, get_gpt_layer_flashoverlap_spec

    with pytest.raises(ValueError, match="flex dispatcher"):  # MoE builds (test_moe_gpt.py); flex does not
        flashoverlap_layer_spec(SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="flex"))
    with pytest.raises(ValueError, match="multi-latent"):
        flashoverlap_layer_spec(SimpleNamespace(multi_latent_attention=True))
    clean_config.activate(clean_config.from_dict({"attention": {"query_split": True}}))
    with pytest.raises(ValueError, match="set --sequence-parallel"):
        flashoverlap_layer_spec(SimpleNamespace(sequence_parallel=False))
    with pytest.raises(ValueError, match="pass sequence_parallel=True"):
        get_gpt_layer_flashoverlap_spec()  # the stock signature cannot say whether SP is on


def test_signature_spec_takes_every_argument_of_the_stock_local_spec():
    """Megatron's own signature is the expected value (0.19: same names, same order; 0.16.1's extra
    `moe_use_legacy_grouped_gemm` by keyword)."""
    import inspect

    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_flashoverlap.spec import get_gpt_layer_flashoverlap_spec

    stock = inspect.signature(gpt_layer_specs.get_gpt_layer_local_spec).parameters
    if list(stock) == ["args", "kwargs"]:  # 0.19 copies the submodules builder's signature at run time
        stock = inspect.signature(gpt_layer_specs.get_gpt_layer_local_submodules).parameters
    ours = inspect.signature(get_gpt_layer_flashoverlap_spec).parameters
    assert all(name in ours and ours[name].default == p.default for name, p in stock.items()), (list(stock), list(ours))
    positional = [n for n, p in ours.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if "moe_use_legacy_grouped_gemm" not in stock:
        assert positional == list(stock)


@pytest.mark.parametrize("qk_layernorm, normalization, query_split", [
    (False, "LayerNorm", False), (True, "RMSNorm", False), (False, "LayerNorm", True), (False, "LayerNorm", "auto")],
    ids=["layernorm", "rmsnorm_qk_norm", "query_split", "query_split_auto"])
def test_every_spec_entry_builds_the_same_model(pools, qk_layernorm, normalization, query_split):
    """flashoverlap_layer_spec(config) == get_gpt_layer_flashoverlap_spec(same settings) == the ModuleSpec
    flashoverlap_layer: same keys and shapes, logits exactly equal (the same modules from the same seed run
    the same code)."""
    for res in pools(2).run("tests.megatron.mp_megatron_layers:spec_equivalence", qk_layernorm, normalization,
                            query_split, timeout=300):
        keys = res["keys"]
        assert keys["config"] == keys["signature"] == keys["module_spec"] and keys["config"]
        assert res["logits_equal"]
        want = "QuerySplitDotProductAttention" if query_split else "DotProductAttention"  # stock's (local impl)
        assert set(res["core_attention"].values()) == {want}
        q_norms = set(res["q_layernorm"].values())  # no qk norm: None (0.19) or IdentityOp (0.16)
        assert len(q_norms) == 1 and q_norms.isdisjoint({"NoneType", "IdentityOp"}) == qk_layernorm, q_norms


def test_all_reduce_settings_and_timeout_reach_the_nosp_layer(pools):
    """The flash ring of matmul_all_reduce per sequence chunk: RS then AG, P-1 sends each at P=2, so the
    sends of one forward grow with all_reduce.num_chunks (3 chunks: 3x the sends of 1)."""
    sends, timeouts, missing = pools(2).run("tests.megatron.mp_megatron_layers:nosp_chunks_and_timeout",
                                            timeout=300)[0]
    assert sends[1] > 0 and sends[3] == 3 * sends[1], sends
    assert timeouts == {1: 41.0, 3: 43.0}
    assert missing and "all_reduce.table 'no/such.json': no such file" in missing and "calibrate_allreduce" in missing


def test_cpu_enable_is_idempotent_and_patches_only_on_cpu(pools):
    assert pools(2).run("tests.megatron.mp_megatron_layers:cpu_shims", timeout=300)[0] == (
        True, True, True, False, "cpu", "cpu")
