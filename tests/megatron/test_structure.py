"""Model structure under our spec: the same layers as stock's per-layer block spec, or a ValueError naming the fix.

Tier 1 (in-process, both lanes): which layers are MoE (stock's own get_gpt_decoder_layer_specs is the expected
value), the refusals (every setting the spec does not build as stock does, and FP8/FP4 at spec build time).
Tier 3 (gloo pool, both lanes): each pipeline stage's decoder block, stock vs ours (flashoverlap_layer_spec and
the ModuleSpec flashoverlap_layer), under --moe-layer-freq with PP=2 (even, uneven first stage, a layout) and
VP stages: the same parameter names, shapes and layer kinds. Bodies in tests/megatron/mp_structure.py.
The losses of such a model against stock's: tests/megatron/test_moe_gpt.py; through Megatron's own argument
parsing and GPTModelBuilder: tests/megatron/test_launch.py.
"""
from types import SimpleNamespace

import pytest

from tests.megatron.mp_structure import moe_config

BODY = "tests.megatron.mp_structure"


def _is_moe(layer_spec) -> bool:
    """Whether a layer spec's MLP is Megatron's MoELayer or ours (0.19: a partial; 0.16: a ModuleSpec)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = layer_spec.submodules.mlp
    module = getattr(mlp, "func", getattr(mlp, "module", None))
    return isinstance(module, type) and issubclass(module, MoELayer)


@pytest.mark.parametrize("freq", [2, 3, [0, 1, 1, 0], [1, 0, 0, 0]], ids=str)
def test_moe_layer_freq_gives_stocks_layer_kinds(clean_config, freq):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec, model_layer_specs

    cfg = moe_config(num_layers=4, moe_layer_freq=freq)
    stock = [_is_moe(s) for s in get_gpt_decoder_layer_specs(cfg, use_transformer_engine=False)]
    assert [_is_moe(s) for s in model_layer_specs(cfg)] == stock and 0 < sum(stock)
    block = flashoverlap_layer_spec(cfg)
    assert [_is_moe(s) for s in block.layer_specs] == stock
    # one attention spec for every layer kind: an override through block.submodules (Megatron's builder does
    # it for --attention-backend local) reaches every layer
    assert len({id(s.submodules.self_attention) for s in block.layer_specs}) == 1
    assert block.submodules.self_attention is block.layer_specs[0].submodules.self_attention


def test_bad_moe_layer_freq_names_both_forms(clean_config):
    from megatron_flashoverlap.megatron.spec import moe_layer_pattern

    for freq in ([0, 1], [0, 2, 1], 0):
        with pytest.raises(ValueError, match=r"--moe-layer-freq 2 or --moe-layer-freq '\(\[0\]\+\[1\]\*2\)'"):
            moe_layer_pattern(SimpleNamespace(num_layers=3, num_moe_experts=4, moe_layer_freq=freq))


@pytest.mark.parametrize("kw, words", [
    ({"multi_latent_attention": True}, ["multi-latent", "drop --multi-latent-attention"]),
    ({"experimental_attention_variant": "gated_delta_net"}, ["gated_delta_net", "drop --experimental-attention"]),
    ({"heterogeneous_block_specs": True}, ["heterogeneous", "drop the heterogeneous layers config"]),
    ({"use_kitchen": True}, ["Kitchen", "drop --use-kitchen"]),
    ({"transformer_impl": "inference_optimized"}, ["inference", "--transformer-impl local"]),
    ({"fp8": "hybrid", "fp8_recipe": "blockwise"}, ["--fp8-recipe blockwise", "use --fp8-recipe tensorwise or delayed"]),
    ({"fp4": "e2m1"}, ["--fp4-format e2m1", "drop --fp4-format"]),
    ({"fp8_param": True}, ["--fp8-param-gather", "Transformer Engine's FP8"]),
    ({"fp4_param": True}, ["--fp4-param-gather"]),
    ({"fp8_dot_product_attention": True}, ["fp8_dot_product_attention"]),
], ids=["mla", "experimental_attention", "heterogeneous", "kitchen", "inference_optimized", "fp8", "fp4", "fp8_param", "fp4_param", "fp8_attention"])
def test_spec_refuses_what_it_does_not_build_as_stock(clean_config, kw, words):
    """Megatron's model config as the --spec entry sees it (SimpleNamespace: some of these need TE or extra
    settings to construct a real TransformerConfig; the spec reads them by name either way)."""
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer, flashoverlap_layer_spec

    from megatron.core.transformer.spec_utils import build_module

    cfg = SimpleNamespace(num_layers=2, pipeline_model_parallel_size=1, **kw)
    with pytest.raises(ValueError) as err:
        flashoverlap_layer_spec(cfg)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    with pytest.raises(ValueError, match=words[0].replace("(", r"\(")):  # the module spec's layers: the same check
        build_module(flashoverlap_layer, config=cfg)


@pytest.mark.parametrize("field", ["use_te_activation_func", "use_grouped_gemm_for_dense_mlp",
                                   "use_transformer_engine_op_fuser"])
def test_te_only_mlp_flags_are_refused_where_stock_builds_them(clean_config, field):
    flag = "--" + field.replace("_", "-")  # the message names the flag the user typed
    """Stock's TE spec builds them; its local spec ignores them (the same model as ours: no refusal there)."""
    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    te = SimpleNamespace(num_layers=2, pipeline_model_parallel_size=1, transformer_impl="transformer_engine",
                         **{field: True})
    with pytest.raises(ValueError, match=f"{flag} .*which the --flash-overlap spec does not build"):
        flashoverlap_layer_spec(te)
    local = SimpleNamespace(**{**vars(te), "transformer_impl": "local"})
    assert len(flashoverlap_layer_spec(local).layer_specs) == 2


def test_fp8_is_refused_where_users_build_their_own_model(clean_config):
    """layer_spec(...) has no model config: the linear refuses FP8 when the model is built with one."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.tensor_parallel import ColumnParallelLinear  # noqa: F401  (the stock class it subclasses)

    from megatron_flashoverlap.megatron.spec import layer_spec, submodules_of

    qkv = submodules_of(layer_spec().submodules.self_attention).linear_qkv
    cfg = moe_config(num_moe_experts=None, moe_ffn_hidden_size=None, fp8="hybrid", fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="FlashColumnParallelLinear: --fp8-recipe blockwise .*use --fp8-recipe "
                                         "tensorwise or delayed"):
        build_module(qkv, 32, 96, config=cfg, init_method=cfg.init_method, gather_output=False, bias=False,
                     skip_bias_add=False, is_expert=False, tp_comm_buffer_name="qkv")


STAGES = {  # name: (pp, vpp, structure)
    "pp2_even": (2, None, {"num_layers": 4, "moe_layer_freq": [0, 1, 1, 0]}),
    "pp2_int_freq": (2, None, {"num_layers": 4, "moe_layer_freq": 3}),
    "pp2_uneven_first": (2, None, {"num_layers": 5, "moe_layer_freq": [0, 1, 0, 1, 1],
                                   "num_layers_in_first_pipeline_stage": 2}),
    "pp2_layout": (2, None, {"num_layers": 5, "moe_layer_freq": [1, 0, 0, 1, 1],
                             "pipeline_model_parallel_layout": "Et|ttttL"}),
    "pp2_vp2": (2, 2, {"num_layers": 8, "moe_layer_freq": [0, 1, 1, 0, 0, 0, 1, 1]}),
}


@pytest.mark.parametrize("case", sorted(STAGES))
def test_each_pipeline_stage_builds_stocks_layers(pools, case):
    pp, vpp, kw = STAGES[case]
    per_rank = pools(2).run(f"{BODY}:stage_blocks", pp, vpp, kw, timeout=300)
    numbers = []
    for stages in per_rank:
        for built in stages:
            stock = built["stock"]
            assert stock["layers"], "every stage of these cases holds a layer"
            for name in ("block", "module"):
                assert built[name] == stock, (case, name, built[name]["layers"], stock["layers"])
            numbers += [n for n, _ in stock["layers"]]
    assert sorted(numbers) == list(range(1, kw["num_layers"] + 1))  # the stages together: the whole model
