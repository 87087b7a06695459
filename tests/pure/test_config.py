"""Tier 1 (no processes): FlashOverlapConfig, its YAML loader, every configs/*.yaml, the environment and the
active config. Expected values are written out here, never read from the module under test."""
import dataclasses
from pathlib import Path

import pytest

from megatron_flashoverlap import config as fc
from megatron_flashoverlap.config import (LAYERS, Environment, FlashOverlapConfig, OpPlan, activate, active,
                                          environment, from_dict, load_config, uniform)

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"stock": ("reference", None), "slicing": ("slicing", 4), "flash": ("flash", None),
            "te_tp_comm_overlap": ("reference", None), "auto": ("auto", None)}
QUIET = Environment()  # an empty environment: from_dict(..., QUIET) depends on the mapping only


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("FLASHOVERLAP_CONFIG", "FLASHOVERLAP_TIMEOUT_S", "FLASHOVERLAP_ALLREDUCE_TABLE",
                "FLASHOVERLAP_QUERY_SPLIT", "FLASHOVERLAP_ULYSSES"):
        monkeypatch.delenv(var, raising=False)
    previous = activate(None)
    yield
    activate(previous)


def test_every_config_file_is_tested():
    assert sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_file_loads(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    algo, chunks = EXPECTED[name]
    assert [cfg.plan(layer) for layer in ("qkv", "proj", "fc1", "fc2")] == [OpPlan(algo, chunks)] * 4
    assert cfg.description and cfg.timeout_s is None and cfg.attention.query_split == "auto"


def test_te_file_documents_the_stock_gpu_run():
    stock = load_config(ROOT / "configs" / "te_tp_comm_overlap.yaml").stock_megatron
    assert "--tp-comm-overlap" in stock["args"] and "--sequence-parallel" in stock["args"]
    assert set(stock["requires"]) == {"cuda", "transformer_engine"}
    te_sites = {f"{layer}_{p}" for layer in ("qkv", "proj", "fc1", "fc2") for p in ("fprop", "dgrad", "wgrad")}
    assert set(stock["tp_comm_overlap_cfg"]) == te_sites  # TE's ub_cfg keys: 12 GEMM sites


def test_default_is_auto_everywhere_and_frozen():
    """auto: stock or flash measured at each site's first training step, so the flag alone never runs a site
    slower than stock where the measurement can see it (plan/chooser.py)."""
    cfg = FlashOverlapConfig()
    assert {cfg.plan(layer).algo for layer in LAYERS} == {"auto"}
    assert (cfg.all_reduce.num_chunks, cfg.all_reduce.table, cfg.attention.ulysses_algo) == (None, None, "auto")
    assert cfg.moe.algo == "auto"
    assert cfg.attention.core == "auto"  # the core attention stock builds for the flags (megatron/sdpa.py)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.qkv = OpPlan("reference")


def test_per_layer_override_and_knobs():
    cfg = from_dict({"default": {"algo": "flash"}, "proj": {"algo": "slicing", "num_chunks": 2},
                     "qkv": {"algo": "flash_bidir", "keep_gathered": True}, "fc2": {"algo": "reference"},
                     "all_reduce": {"num_chunks": 3}, "attention": {"query_split": True,
                                                                   "ulysses_algo": "reference"},
                     "timeout_s": 12.5}, QUIET)
    assert cfg.plan("proj") == OpPlan("slicing", 2) and cfg.plan("qkv") == OpPlan("flash_bidir", keep_gathered=True)
    assert cfg.plan("fc1") == OpPlan("flash") and cfg.plan("fc2").is_reference
    assert cfg.all_reduce.num_chunks == 3 and cfg.attention.query_split and cfg.timeout_s == 12.5
    assert cfg.attention.ulysses_algo == "reference"


def test_uniform_keep_gathered_reaches_column_layers_only():
    cfg = uniform("flash", keep_gathered=True)
    assert cfg.plan("qkv").keep_gathered and cfg.plan("fc1").keep_gathered
    assert not cfg.plan("proj").keep_gathered and not cfg.plan("fc2").keep_gathered


@pytest.mark.parametrize("data, words", [
    ({"qkv_dgrad": {"algo": "slicing", "num_chunks": 2}}, ["qkv_dgrad", "one algorithm", "qkv: {algo"]),
    ({"fc2_wgrad": {"algo": "flash"}}, ["fc2_wgrad", "one algorithm", "fc2: {algo"]),
    ({"proj_fprop": {"algo": "flash"}}, ["proj_fprop", "proj: {algo"]),
    ({"qkvv": {}}, ["unknown key", "'qkv'", "'all_reduce'"]),
    ({"default": {"algo": "fast"}}, ["unknown algo 'fast'", "'flash_bidir'", "'reference'"]),
    ({"default": {"algo": "off"}}, ["'off' is now called 'reference'", "algo: reference"]),
    ({"qkv": {"algo": False}}, ["'off' is now called 'reference'"]),  # YAML 1.1: bare `off` is false
    ({"qkv": {"algo": "flash", "chunks": 2}}, ["qkv: unknown knob", "num_chunks"]),
    ({"default": {"algo": "flash", "chunks": 2}, **{k: {} for k in ("qkv", "proj", "fc1", "fc2")}},
     ["default: unknown knob"]),
    ({"default": {"algo": "slicing"}}, ["num_chunks >= 1"]),
    ({"proj": {"algo": "slicing", "num_chunks": 0}}, ["num_chunks must be an integer >= 1"]),
    ({"fc1": {"algo": "flash", "num_chunks": 2}}, ["slicing' only"]),
    ({"proj": {"keep_gathered": True}}, ["column layers", "proj"]),
    ({"fc2": {"algo": "slicing", "num_chunks": 2, "hop_chunks": 2}}, ["fc2: hop_chunks is a knob of algo 'flash'"]),
    ({"fc1": {"algo": "flash_bidir", "hop_chunks": 2}}, ["hop_chunks is a knob of algo 'flash'"]),
    ({"qkv": {"algo": "flash", "hop_chunks": 0}}, ["hop_chunks must be an integer >= 1"]),
    ({"qkv": "flash"}, ["expected a mapping"]),
    ({"attention": {"ulysses_algo": "stock"}}, ["'stock' is now called 'reference'"]),
    ({"attention": {"query_split": "yes"}}, ["query_split must be true, false or auto"]),
    ({"attention": {"split": True}}, ["attention: unknown key", "query_split"]),
    ({"attention": {"core": "te"}}, ["attention.core 'te'", "auto", "megatron", "sdpa"]),
    ({"all_reduce": {"num_chunks": 2.5}}, ["all_reduce.num_chunks must be an integer"]),
    ({"timeout_s": 0}, ["timeout_s must be a number of seconds > 0"]),
])
def test_bad_config_is_a_clear_error(data, words):
    with pytest.raises(ValueError) as err:
        from_dict(data, QUIET)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_environment_fills_what_the_yaml_leaves_out():
    env = environment({"FLASHOVERLAP_TIMEOUT_S": "7", "FLASHOVERLAP_ALLREDUCE_TABLE": "t.json",
                       "FLASHOVERLAP_QUERY_SPLIT": "1", "FLASHOVERLAP_ULYSSES": "reference",
                       "FLASHOVERLAP_CORE_ATTENTION": "sdpa"})
    silent = from_dict({}, env)
    assert (silent.timeout_s, silent.all_reduce.table, silent.attention.query_split,
            silent.attention.ulysses_algo, silent.attention.core) == (7.0, "t.json", True, "reference", "sdpa")
    said = from_dict({"timeout_s": 9, "all_reduce": {"table": "mine.json"},
                      "attention": {"query_split": False, "ulysses_algo": "flash", "core": "megatron"}}, env)
    assert (said.timeout_s, said.all_reduce.table, said.attention.query_split,
            said.attention.ulysses_algo, said.attention.core) == (9, "mine.json", False, "flash", "megatron")


@pytest.mark.parametrize("value, word", [(None, "auto"), ("auto", "auto"), ("1", True), ("0", False)])
def test_query_split_defaults_to_auto_and_the_environment_can_say_each_word(value, word):
    env = environment({} if value is None else {"FLASHOVERLAP_QUERY_SPLIT": value})
    assert from_dict({}, env).attention.query_split == word and type(from_dict({}, env).attention.query_split) is type(word)


@pytest.mark.parametrize("var, value, words", [
    ("FLASHOVERLAP_TIMEOUT_S", "soon", ["FLASHOVERLAP_TIMEOUT_S", "number of seconds"]),
    ("FLASHOVERLAP_TIMEOUT_S", "-1", ["must be > 0"]),
    ("FLASHOVERLAP_QUERY_SPLIT", "yes", ["use 1 (on), 0 (off) or auto"]),
    ("FLASHOVERLAP_ULYSSES", "stock", ["FLASHOVERLAP_ULYSSES", "'stock' is now called 'reference'"]),
    ("FLASHOVERLAP_CORE_ATTENTION", "flash", ["FLASHOVERLAP_CORE_ATTENTION", "auto", "megatron", "sdpa"]),
])
def test_bad_environment_names_the_variable(var, value, words):
    with pytest.raises(ValueError) as err:
        environment({var: value})
    for w in words:
        assert w in str(err.value)


def test_active_is_the_activated_config_else_the_env_file_else_defaults(monkeypatch, tmp_path):
    assert active() == FlashOverlapConfig()  # nothing activated, no variables: the defaults
    path = tmp_path / "c.yaml"
    path.write_text("default: {algo: slicing, num_chunks: 2}\n")
    monkeypatch.setenv("FLASHOVERLAP_CONFIG", str(path))
    assert active().plan("fc2") == OpPlan("slicing", 2)
    mine = uniform("flash_bidir")
    assert activate(mine) is None and active() is mine  # activated wins over $FLASHOVERLAP_CONFIG
    assert activate(None) is mine and active().plan("fc2") == OpPlan("slicing", 2)
    with pytest.raises(ValueError, match="takes a FlashOverlapConfig"):
        activate(str(path))


def test_relative_path_resolves_against_the_working_directory(monkeypatch, tmp_path):
    (tmp_path / "mine.yaml").write_text("fc1: {algo: flash_bidir}\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("mine.yaml").plan("fc1").algo == "flash_bidir"


def test_bad_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("qkv: {algo: warp}\n")
    with pytest.raises(ValueError, match="bad.yaml: qkv: unknown algo 'warp'"):
        load_config(bad)


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("description: ok\nqkv: {algo: flash\nfc1: {algo: slicing}\n")  # the brace never closes
    with pytest.raises(ValueError) as err:
        load_config(broken)
    assert f"{broken}:3:" in str(err.value) and "not valid YAML" in str(err.value), str(err.value)


def test_unknown_layer_plan():
    with pytest.raises(ValueError, match="tp_comm_buffer_name"):
        FlashOverlapConfig().plan("output_layer")


def test_the_word_lists_are_the_agreed_ones():
    assert fc.ALGOS == ("flash", "flash_bidir", "slicing", "reference")
    assert fc.ULYSSES_ALGOS == ("flash", "reference") and "reference" in fc.ALL_REDUCE_ALGOS


def test_hop_chunks_is_a_flash_knob_per_layer():
    cfg = from_dict({"default": {"algo": "flash", "hop_chunks": 3}, "fc2": {"algo": "flash"}}, QUIET)
    assert cfg.plan("fc1").hop_chunks == 3 and cfg.plan("proj").hop_chunks == 3
    assert cfg.plan("fc2").hop_chunks is None  # a layer's own entry replaces the default: automatic


def test_planner_probe_reads_yamls_bare_off_and_refuses_a_bare_on(tmp_path):
    """YAML 1.1 reads a bare `off` as false and `on` as true: `off` is the documented word, `on` is ambiguous."""
    path = tmp_path / "probe.yaml"
    path.write_text("planner: {probe: off}\n")
    assert load_config(path).planner.probe == "off"
    path.write_text("planner: {probe: always}\n")
    assert load_config(path).planner.probe == "always"
    path.write_text("planner: {probe: on}\n")
    with pytest.raises(ValueError, match="write always"):
        load_config(path)
