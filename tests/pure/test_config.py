"""Tier 1 (no processes): the per-site FlashOverlapConfig, its YAML loader and every configs/*.yaml."""
import dataclasses
from pathlib import Path

import pytest

from megatron_flashoverlap.config import (LAYERS, SITE_ALGOS, SITES, FlashOverlapConfig, SiteConfig, from_dict,
                                          load_config, uniform)

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"stock": ("off", None), "slicing": ("slicing", 4), "flash": ("flash", None),
            "te_tp_comm_overlap": ("off", None)}


def test_every_config_file_is_tested():
    assert sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_file_loads(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    algo, chunks = EXPECTED[name]
    for layer in LAYERS:
        plan = cfg.plan(layer)
        assert (plan.algo, plan.num_chunks, plan.keep_gathered) == (algo, chunks, False)
    assert cfg.description


def test_te_file_documents_the_stock_gpu_run():
    stock = load_config(ROOT / "configs" / "te_tp_comm_overlap.yaml").stock_megatron
    assert "--tp-comm-overlap" in stock["args"] and "--sequence-parallel" in stock["args"]
    assert set(stock["requires"]) == {"cuda", "transformer_engine"}
    assert set(stock["tp_comm_overlap_cfg"]) == set(SITES)  # TE's ub_cfg keys are our site names


def test_sites_are_te_names():
    assert len(SITES) == 12 and "fc1_dgrad" in SITES and "proj_wgrad" in SITES


def test_default_is_flash_everywhere_and_frozen():
    cfg = FlashOverlapConfig()
    assert {cfg.plan(layer).algo for layer in LAYERS} == {"flash"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.qkv_fprop = SiteConfig("off")


def test_per_site_override_and_knobs():
    cfg = from_dict({"default": {"algo": "flash"}, "proj_fprop": {"algo": "slicing", "num_chunks": 2},
                     "qkv_fprop": {"algo": "flash_bidir", "keep_gathered": True},
                     "fc1_wgrad": {"algo": "flash", "keep_gathered": True}, "fc2_fprop": {"algo": "off"}})
    assert cfg.plan("proj").algo == "slicing" and cfg.plan("proj").num_chunks == 2
    assert cfg.plan("qkv").keep_gathered and cfg.plan("qkv").algo == "flash_bidir"
    assert cfg.plan("fc1").keep_gathered  # set on the wgrad site: that is where the gathered x is used
    assert cfg.plan("fc2").stock


def test_yaml_bare_off_means_off(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("default: {algo: off}\n")  # YAML 1.1 reads bare `off` as false
    assert load_config(path).plan("qkv").stock


def test_uniform_keep_gathered_reaches_column_layers_only():
    cfg = uniform("flash", keep_gathered=True)
    assert cfg.plan("qkv").keep_gathered and cfg.plan("fc1").keep_gathered
    assert not cfg.plan("proj").keep_gathered and not cfg.plan("fc2").keep_gathered


@pytest.mark.parametrize("data, words", [
    ({"qkv_fprp": {}}, ["unknown site", "qkv_fprop"]),
    ({"default": {"algo": "fast"}}, ["unknown algo 'fast'", str(SITE_ALGOS)]),
    ({"qkv_fprop": {"algo": "flash", "chunks": 2}}, ["unknown knob", "num_chunks"]),
    ({"default": {"algo": "slicing"}}, ["num_chunks >= 1"]),
    ({"fc1_fprop": {"algo": "flash", "num_chunks": 2}}, ["slicing' only"]),
    ({"qkv_dgrad": {"algo": "slicing", "num_chunks": 2}}, ["qkv_dgrad", "differs from qkv_fprop", "one algorithm"]),
    ({"proj_fprop": {"keep_gathered": True}}, ["column layers", "proj"]),
    ({"qkv_fprop": "flash"}, ["expected a mapping"]),
])
def test_bad_config_is_a_clear_error(data, words):
    with pytest.raises(ValueError) as err:
        from_dict(data)
    for w in words:
        assert w in str(err.value)


def test_matching_backward_site_is_accepted():
    cfg = from_dict({"fc2_fprop": {"algo": "slicing", "num_chunks": 2},
                     "fc2_dgrad": {"algo": "slicing", "num_chunks": 2}})
    assert cfg.plan("fc2").num_chunks == 2


def test_bad_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("qkv_fprop: {algo: warp}\n")
    with pytest.raises(ValueError, match="bad.yaml: qkv_fprop: unknown algo 'warp'"):
        load_config(bad)


def test_unknown_layer_plan():
    with pytest.raises(ValueError, match="tp_comm_buffer_name"):
        FlashOverlapConfig().plan("output_layer")
