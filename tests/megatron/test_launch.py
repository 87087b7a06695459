"""The --flash-overlap flag: argument plumbing, spec selection, config loading; never the training loop.

Tier 1 (no processes, both lanes): our argparse provider, `apply_flash_overlap_args`, the errors.
Tier 1b (newest lane: megatron.training ships in the megatron-core wheel from 0.17 on; the 0.16.1 wheel has
no megatron.training, so those tests are marked newest_only): the launcher wraps Megatron's real
`parse_args`, and a subprocess runs the launcher on a script doing what Megatron-LM 0.19's
`pretrain_gpt.py` `__main__` does before `pretrain()`, then builds the model with Megatron's own
`GPTModelBuilder` on one CPU rank.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_flashoverlap.megatron import launch
from megatron_flashoverlap.megatron.args import SPEC, activate_config, apply_flash_overlap_args, with_flash_overlap_args
from megatron_flashoverlap.config import load_config
from megatron_flashoverlap.megatron.spec import ENV_CONFIG, resolve_flash_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PATCH = ROOT / "patches" / "megatron-lm-core_v0.19.0-flash-overlap" / "flash-overlap.patch"


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch):
    monkeypatch.delenv(ENV_CONFIG, raising=False)


def ns(**kw):
    base = {"flash_overlap": False, "flash_overlap_config": None, "spec": None, "tp_comm_overlap": False,
            "attention_backend": None}
    return argparse.Namespace(**{**base, **kw})


# ------------------------------------------------------------------------------------------- tier 1
def test_provider_adds_flags_then_calls_the_scripts_own():
    def own(parser):
        parser.add_argument("--own-flag", type=int, default=3)
        return parser

    parser = with_flash_overlap_args(own)(argparse.ArgumentParser())
    args = parser.parse_args(["--flash-overlap", "--flash-overlap-config", "x.yaml", "--own-flag", "5"])
    assert (args.flash_overlap, args.flash_overlap_config, args.own_flag) == (True, "x.yaml", 5)
    assert parser.parse_args([]).flash_overlap is False
    with_flash_overlap_args(None)(parser)  # launcher on a patched script: adding twice is a no-op


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_flag_selects_our_spec_and_publishes_each_config(path):
    args = apply_flash_overlap_args(ns(flash_overlap=True, flash_overlap_config=str(path)))
    assert args.spec == SPEC
    assert os.environ[ENV_CONFIG] == str(path)
    assert resolve_flash_config(None) == load_config(path)  # what the spec sees == the file


def test_spec_pair_imports_as_megatron_does():
    from megatron.core.transformer.spec_utils import import_module

    from megatron_flashoverlap.megatron.spec import flashoverlap_layer_spec

    args = apply_flash_overlap_args(ns(flash_overlap=True))
    assert import_module(args.spec) is flashoverlap_layer_spec
    assert ENV_CONFIG not in os.environ  # no file given: the spec's default (flash everywhere)


def test_flag_off_changes_nothing():
    args = apply_flash_overlap_args(ns(spec=["local"]))
    assert args.spec == ["local"] and ENV_CONFIG not in os.environ


@pytest.mark.parametrize("kw, words", [
    ({"flash_overlap": True, "flash_overlap_config": "no/such.yaml"}, ["no such file", "configs/flash.yaml"]),
    ({"flash_overlap_config": str(ROOT / "configs" / "flash.yaml")}, ["without --flash-overlap", "add"]),
    ({"flash_overlap": True, "spec": ["my.mod", "my_spec"]}, ["drop --spec"]),
    ({"flash_overlap": True, "tp_comm_overlap": True}, ["drop --tp-comm-overlap"]),
], ids=["missing_file", "config_without_flag", "other_spec", "tp_comm_overlap"])
def test_bad_flags_name_the_fix(kw, words):
    with pytest.raises(ValueError) as err:
        apply_flash_overlap_args(ns(**kw))
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert ENV_CONFIG not in os.environ


def test_local_attention_backend_is_refused():
    from megatron.core.transformer.enums import AttnBackend

    with pytest.raises(ValueError, match="--attention-backend local"):
        apply_flash_overlap_args(ns(flash_overlap=True, attention_backend=AttnBackend.local))


def test_bad_yaml_content_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("qkv_fprob: {algo: flash}\n")
    with pytest.raises(ValueError, match="bad.yaml.*unknown site"):
        activate_config(str(bad))
    assert ENV_CONFIG not in os.environ


def test_launcher_refuses_a_missing_script():
    with pytest.raises(SystemExit, match="no such file"):
        launch.main(["no/such/pretrain_gpt.py", "--flash-overlap"])
    with pytest.raises(SystemExit, match="usage"):
        launch.main([])


def test_launcher_says_where_megatron_training_comes_from():
    """megatron.training ships in the megatron-core wheel from 0.17 on (a Megatron-LM checkout has it too)."""
    if importlib.util.find_spec("megatron.training") is None:  # the oldest lane: megatron-core 0.16.1
        with pytest.raises(SystemExit, match="megatron-core >= 0.17"):
            launch.install()
    else:
        try:
            assert launch.install().parse_args._flash_overlap
            assert launch._callable_spec_supported()  # 0.19: --spec may be a function of the model config
        finally:
            launch.uninstall()


def test_patch_adds_only_our_two_calls():
    """The patch touches pretrain_gpt.py only, and the names it imports exist."""
    text = PATCH.read_text()
    assert [ln for ln in text.splitlines() if ln.startswith("+++ ")] == ["+++ b/pretrain_gpt.py"]
    added = [ln[1:] for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    imports = [ln for ln in added if ln.startswith("from megatron_flashoverlap")]
    assert len(imports) == 1
    exec(imports[0], {})  # noqa: S102 - the patch's own import line must resolve
    assert any("with_flash_overlap_args(" in ln for ln in added)
    assert any(ln.strip().startswith("apply_flash_overlap_args(args)") for ln in added)


# ------------------------------------------------------------------------- tier 1b: megatron.training
MEGATRON_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                 "32", "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "128",
                 "--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", "1",
                 "--transformer-impl", "local", "--use-cpu-initialization",
                 # apex/TE-only fusions Megatron-LM turns on by default: off for a CPU build
                 "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                 "--no-bias-gelu-fusion", "--no-bias-dropout-fusion"]


@pytest.mark.newest_only
def test_launcher_wraps_megatrons_parse_args(monkeypatch):
    arguments = launch.install()
    try:
        assert launch.install() is arguments and arguments.parse_args._original is not None  # idempotent
        cfg = str(ROOT / "configs" / "slicing.yaml")
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGS, "--flash-overlap",
                                          "--flash-overlap-config", cfg])
        args = arguments.parse_args()
        assert (args.flash_overlap, args.spec, os.environ[ENV_CONFIG]) == (True, SPEC, cfg)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGS])
        assert arguments.parse_args().spec is None  # no flag: stock
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGS, "--flash-overlap",
                                          "--flash-overlap-config", "missing.yaml"])
        with pytest.raises(ValueError, match="no such file"):
            arguments.parse_args()
    finally:
        launch.uninstall()
    assert not getattr(arguments.parse_args, "_flash_overlap", False)


# What Megatron-LM core_v0.19.0 pretrain_gpt.py's __main__ does up to pretrain(), then what pretrain()'s
# GPTModelBuilder.build_model does with the spec, on one gloo CPU rank (the training loop needs CUDA).
PRETRAIN_STAND_IN = '''
import json
from megatron.training.arguments import parse_and_validate_args
from megatron.training.argument_utils import gpt_config_from_args
args = parse_and_validate_args(extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
model_cfg = gpt_config_from_args(args)

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.training.models.gpt import GPTModelBuilder
from megatron_flashoverlap.megatron import cpu
cpu.enable()
dist.init_process_group("gloo", rank=0, world_size=1)  # MASTER_ADDR/PORT from the test
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)
model = GPTModelBuilder(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
layer = model.decoder.layers[0]
linears = {"qkv": layer.self_attention.linear_qkv, "proj": layer.self_attention.linear_proj,
           "fc1": layer.mlp.linear_fc1, "fc2": layer.mlp.linear_fc2}
print("RESULT " + json.dumps({
    "flash_overlap": args.flash_overlap, "spec": args.spec,
    "classes": {k: type(m).__name__ for k, m in linears.items()},
    "plans": {k: [m.flash_plan.algo, m.flash_plan.num_chunks] for k, m in linears.items()}}))
dist.destroy_process_group()
'''


@pytest.mark.newest_only
def test_launcher_runs_a_pretrain_script_and_megatron_builds_our_layers(tmp_path):
    from megatron_flashoverlap.testing.pool import _free_port

    script = tmp_path / "pretrain_gpt.py"
    script.write_text(PRETRAIN_STAND_IN)
    cfg = ROOT / "configs" / "slicing.yaml"  # not the default: proves the file reached the layers
    cmd = [sys.executable, "-m", "megatron_flashoverlap.launch", str(script), *MEGATRON_ARGS,
           "--flash-overlap", "--flash-overlap-config", str(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert result["flash_overlap"] is True and result["spec"] == SPEC
    assert result["classes"] == {"qkv": "FlashColumnParallelLinear", "proj": "FlashRowParallelLinear",
                                 "fc1": "FlashColumnParallelLinear", "fc2": "FlashRowParallelLinear"}
    expected = load_config(cfg)
    assert result["plans"] == {k: [expected.plan(k).algo, expected.plan(k).num_chunks] for k in result["plans"]}


# --------------------------------------------------------------------------- tier 1: --cpu, options
def test_cpu_defaults_fill_only_what_the_user_left_out():
    argv = launch.cpu_argv(["--num-layers", "2", "--distributed-backend=gloo", "--transformer-impl", "local",
                            "--no-rope-fusion"])
    assert argv[:5] == ["--num-layers", "2", "--distributed-backend=gloo", "--transformer-impl", "local"]
    assert argv.count("--no-rope-fusion") == 1 and "--distributed-backend" not in argv
    assert argv.count("--transformer-impl") == 1
    for flag in ("--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-gelu-fusion"):
        assert flag in argv
    added = launch.cpu_argv([])
    assert added[added.index("--distributed-backend") + 1] == "gloo"


def test_launcher_options_lead_the_script():
    assert launch.launcher_options(["--cpu", "--nproc-per-node", "2", "s.py", "--cpu"]) == (True, 2, ["s.py", "--cpu"])
    assert launch.launcher_options(["--nproc-per-node=4", "s.py"]) == (False, 4, ["s.py"])
    assert launch.launcher_options(["s.py", "--nproc-per-node", "2"]) == (False, None, ["s.py", "--nproc-per-node", "2"])
    with pytest.raises(SystemExit, match="positive integer"):
        launch.launcher_options(["--nproc-per-node", "two", "s.py"])


def test_cpu_shims_refuse_an_unsupported_megatron_by_name():
    from megatron_flashoverlap.megatron import cpu

    for ok in ("0.16.1", "0.19.2+709d5ee", "0.17.0rc1"):
        cpu.check_version(ok)
    for bad in ("0.15.3", "0.20.0", "1.0.0", "dev"):
        with pytest.raises(ValueError, match=r"0\.16\.x, 0\.17\.x, 0\.18\.x, 0\.19\.x; found"):
            cpu.check_version(bad)
