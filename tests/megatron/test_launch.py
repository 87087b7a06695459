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

from megatron_flashoverlap import config as fc
from megatron_flashoverlap.megatron.cli import launch
from megatron_flashoverlap.megatron.cli.args import SPEC, activate_config, apply_flash_overlap_args, with_flash_overlap_args
from megatron_flashoverlap.config import FlashOverlapConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PATCH = ROOT / "patches" / "megatron-lm-core_v0.19.0-flash-overlap" / "flash-overlap.patch"


ENV_CONFIG = "FLASHOVERLAP_CONFIG"


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch):
    monkeypatch.delenv(ENV_CONFIG, raising=False)
    previous = fc.activate(None)
    yield
    fc.activate(previous)


def ns(**kw):
    base = {"flash_overlap": False, "flash_overlap_config": None, "spec": None, "tp_comm_overlap": False,
            "attention_backend": None}
    return argparse.Namespace(**{**base, **kw})


# ------------------------------------------------------------------------------------------- tier 1
def test_provider_adds_flags_calls_the_scripts_own_and_applies_at_parse_time():
    def own(parser):
        parser.add_argument("--own-flag", type=int, default=3)
        return parser

    cfg = str(ROOT / "configs" / "slicing.yaml")
    parser = with_flash_overlap_args(own)(argparse.ArgumentParser())
    args = parser.parse_args(["--flash-overlap", "--flash-overlap-config", cfg, "--own-flag", "5"])
    assert (args.flash_overlap, args.flash_overlap_config, args.own_flag, args.spec) == (True, cfg, 5, SPEC)
    assert fc.active() == load_config(cfg)  # applied by the parser itself, before anyone validates args
    known, rest = parser.parse_known_args(["--flash-overlap", "--other"])
    assert known.spec == SPEC and rest == ["--other"]
    assert parser.parse_args([]).flash_overlap is False
    with_flash_overlap_args(None)(parser)  # launcher on a patched script: adding twice is a no-op
    with pytest.raises(ValueError, match="no such file"):
        parser.parse_args(["--flash-overlap", "--flash-overlap-config", "x.yaml"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_flag_selects_our_spec_and_activates_each_config(path):
    args = apply_flash_overlap_args(ns(flash_overlap=True, flash_overlap_config=str(path)))
    assert args.spec == SPEC
    assert fc.active() == load_config(path)  # what the spec sees == the file
    assert ENV_CONFIG not in os.environ  # in-process: no variable written for the spec to read


def test_flag_is_idempotent_and_accepts_our_other_spec_name():
    cfg = str(ROOT / "configs" / "slicing.yaml")
    for spec in (None, ["megatron_flashoverlap.spec", "flashoverlap_layer_spec"]):
        args = apply_flash_overlap_args(ns(flash_overlap=True, flash_overlap_config=cfg, spec=spec))
        assert apply_flash_overlap_args(args).spec == SPEC and fc.active() == load_config(cfg)


def test_relative_config_resolves_against_the_callers_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("default: {algo: flash_bidir}\n")
    monkeypatch.chdir(tmp_path)
    args = apply_flash_overlap_args(ns(flash_overlap=True, flash_overlap_config="mine.yaml"))
    monkeypatch.chdir(ROOT)  # later code (Megatron, a tool reading the saved args) may run elsewhere
    assert args.flash_overlap_config == str(tmp_path / "mine.yaml")
    assert fc.active().plan("qkv").algo == "flash_bidir"
    assert load_config(args.flash_overlap_config) == fc.active()


def test_spec_pair_imports_as_megatron_does_as_a_module_spec():
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from megatron_flashoverlap.megatron.spec import FlashOverlapTransformerLayer, flashoverlap_layer

    args = apply_flash_overlap_args(ns(flash_overlap=True))
    spec = import_module(args.spec)
    assert spec is flashoverlap_layer and isinstance(spec, ModuleSpec)  # legacy paths use it as it is
    assert spec.module is FlashOverlapTransformerLayer and spec.submodules is None
    assert fc.active() == FlashOverlapConfig()  # no file given: the defaults (flash everywhere)


def test_flag_off_changes_nothing():
    args = apply_flash_overlap_args(ns(spec=["local"]))
    assert args.spec == ["local"] and fc.active() == FlashOverlapConfig()


@pytest.mark.parametrize("kw, words", [
    ({"flash_overlap": True, "flash_overlap_config": "no/such.yaml"}, ["no such file", "configs/flash.yaml"]),
    ({"flash_overlap_config": str(ROOT / "configs" / "flash.yaml")}, ["without --flash-overlap", "add"]),
    ({"flash_overlap": True, "spec": ["my.mod", "my_spec"]}, ["drop --spec"]),
    ({"flash_overlap": True, "tp_comm_overlap": True}, ["drop --tp-comm-overlap"]),
    ({"flash_overlap": True, "fp8": "hybrid", "fp8_recipe": "mxfp8"},
     ["--fp8-recipe mxfp8", "use --fp8-recipe tensorwise or delayed", "drop --flash-overlap"]),
    ({"flash_overlap": True, "fp4": "e2m1"}, ["--fp4-format e2m1", "drop --fp4-format"]),
    ({"flash_overlap": True, "fp8_param_gather": True}, ["--fp8-param-gather", "Transformer Engine's FP8"]),
    ({"flash_overlap": True, "fp4_param_gather": True}, ["--fp4-param-gather", "drop --fp4-param-gather"]),
], ids=["missing_file", "config_without_flag", "other_spec", "tp_comm_overlap", "fp8_mxfp8", "fp4",
        "fp8_param_gather", "fp4_param_gather"])
def test_bad_flags_name_the_fix(kw, words):
    with pytest.raises(ValueError) as err:
        apply_flash_overlap_args(ns(**kw))
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert fc.active() == FlashOverlapConfig()  # nothing activated


def test_dp_fuse_all_without_the_ddp_flags_is_refused_naming_them(tmp_path):
    """`dp: {fuse: all}` asks for every TP linear's DP reduce-scatter inside its wgrad GEMM; without
    --use-distributed-optimizer and --overlap-grad-reduce there is none to fuse: refused at parse time (and where
    pretrain() builds DDP), naming both flags, not a stock run said in one start-up line; accepted with them."""
    from megatron_flashoverlap.megatron.ddp.pretrain import refuse_unfusable

    yaml = tmp_path / "all.yaml"
    yaml.write_text("dp: {fuse: all}\n")
    for flags in ({}, {"use_distributed_optimizer": True}, {"overlap_grad_reduce": True}):
        with pytest.raises(ValueError) as err:
            apply_flash_overlap_args(ns(flash_overlap=True, flash_overlap_config=str(yaml), **flags))
        for words in ("dp: {fuse: all}", "--use-distributed-optimizer", "--overlap-grad-reduce", "fuse: auto"):
            assert words in str(err.value), (words, str(err.value))
    apply_flash_overlap_args(ns(flash_overlap=True, flash_overlap_config=str(yaml), use_distributed_optimizer=True,
                                overlap_grad_reduce=True))
    assert fc.active().dp.fuse == "all"
    with pytest.raises(ValueError, match="--overlap-grad-reduce"):  # the DDP-time check: Megatron's own config
        refuse_unfusable("all", True, False)
    refuse_unfusable("auto", False, False)  # auto: stock DDP where the flags are missing, said in one line


def test_local_attention_backend_is_refused():
    from megatron.core.transformer.enums import AttnBackend

    with pytest.raises(ValueError, match="--attention-backend local"):
        apply_flash_overlap_args(ns(flash_overlap=True, attention_backend=AttnBackend.local))


def test_bad_yaml_content_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("qkv_dgrad: {algo: flash}\n")
    with pytest.raises(ValueError, match="bad.yaml.*one algorithm"):
        activate_config(str(bad))
    assert fc.active() == FlashOverlapConfig()


def test_flag_help_documents_cuda_device_max_connections():
    parser = with_flash_overlap_args(None)(argparse.ArgumentParser())
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in parser.format_help()


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


def test_patch_adds_only_our_provider():
    """The patch touches pretrain_gpt.py only, the names it imports exist, and it applies the flags through
    the provider (at parse time), not after parse_and_validate_args (too late: validate_args has run)."""
    text = PATCH.read_text()
    assert [ln for ln in text.splitlines() if ln.startswith("+++ ")] == ["+++ b/pretrain_gpt.py"]
    added = [ln[1:] for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    imports = [ln for ln in added if ln.startswith("from megatron_flashoverlap")]
    assert len(imports) == 1
    exec(imports[0], {})  # noqa: S102 - the patch's own import line must resolve
    assert any("extra_args_provider=with_flash_overlap_args(" in ln for ln in added)
    assert not any("apply_flash_overlap_args" in ln for ln in added)


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
        assert (args.flash_overlap, args.spec, args.flash_overlap_config) == (True, SPEC, cfg)
        assert fc.active() == load_config(cfg)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGS])
        assert arguments.parse_args().spec is None  # no flag: stock
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGS, "--flash-overlap",
                                          "--flash-overlap-config", "missing.yaml"])
        with pytest.raises(ValueError, match="no such file"):
            arguments.parse_args()
    finally:
        launch.uninstall()
    assert not getattr(arguments.parse_args, "_flash_overlap", False)


@pytest.mark.newest_only
def test_launcher_refuses_what_our_fp8_does_not_run_at_parse_time(monkeypatch):
    """`--bf16 --use-distributed-optimizer --fp8-format hybrid --fp8-recipe mxfp8 --flash-overlap` (a block-scaled
    recipe), FP4 and FP8 parameters through the launcher's parse_args: a ValueError naming the choices, before
    Megatron validates anything; without --flash-overlap the same flags are Megatron's to judge."""
    arguments = launch.install()
    try:
        said = {"--fp8-format": "--fp8-recipe mxfp8 .*use --fp8-recipe tensorwise or delayed, or drop --flash-overlap",
                "--fp4-format": "--fp4-format .*drop --fp4-format, or drop --flash-overlap to use Transformer Engine",
                "--fp8-param-gather": "--fp8-param-gather .*drop --fp8-param-gather, or drop --flash-overlap"}
        for flags in (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], ["--fp4-format", "e2m1"],
                      ["--fp8-param-gather"]):
            monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGS, "--bf16",
                                              "--use-distributed-optimizer", *flags, "--flash-overlap"])
            with pytest.raises(ValueError, match=said[flags[0]]):
                arguments.parse_args()
            monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGS, *flags])
            assert arguments.parse_args().spec is None  # stock with FP8: Megatron's to judge, not ours
    finally:
        launch.uninstall()


# Megatron-LM 0.19's argument parsing -> model config -> GPTModelBuilder, as pretrain() builds the model, for
# --moe-layer-freq in both forms: stock (no flag), --flash-overlap (the ModuleSpec flashoverlap_layer) and
# --spec megatron_flashoverlap.spec flashoverlap_layer_spec (the builder calls it with the model config).
FREQ_STAND_IN = '''
import json, sys
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.training import arguments
from megatron.training.argument_utils import gpt_config_from_args
from megatron.training.models.gpt import GPTModelBuilder
from megatron_flashoverlap.megatron import cpu
cpu.enable()
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel()
base, out = sys.argv[1:], {}
ARMS = {"stock": [], "flag": ["--flash-overlap"],
        "callable": ["--spec", "megatron_flashoverlap.spec", "flashoverlap_layer_spec"]}
for freq in ("2", "([0]+[1]*2)"):
    for arm, extra in ARMS.items():
        sys.argv = ["pretrain_gpt.py", *base, "--moe-layer-freq", freq, *extra]
        args = arguments.parse_args()
        arguments.validate_args(args, {})
        model_parallel_cuda_manual_seed(1)
        model = GPTModelBuilder(gpt_config_from_args(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
        out[f"{freq} {arm}"] = {"count": sum(p.numel() for p in model.parameters()),
                                "names": [n for n, _ in model.named_parameters()],
                                "kinds": [type(layer.mlp).__name__ for layer in model.decoder.layers]}
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
'''
MOE_ARGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
            "--moe-ffn-hidden-size", "32", "--disable-bias-linear"]


@pytest.mark.newest_only
def test_moe_layer_freq_builds_stocks_model_through_megatrons_args(tmp_path):
    """Issue 26 item 3: --moe-layer-freq was ignored under --flash-overlap (every layer MoE)."""
    script = tmp_path / "build.py"
    script.write_text(FREQ_STAND_IN)
    base = [a if a != "2" or MEGATRON_ARGS[i - 1] != "--num-layers" else "3" for i, a in enumerate(MEGATRON_ARGS)]
    cmd = [sys.executable, "-m", "megatron_flashoverlap.launch", str(script), *base, *MOE_ARGS]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    for freq, kinds in (("2", ["MoELayer", "MLP", "MoELayer"]), ("([0]+[1]*2)", ["MLP", "MoELayer", "MoELayer"])):
        stock = built[f"{freq} stock"]
        assert stock["kinds"] == kinds
        for arm in ("flag", "callable"):
            ours = built[f"{freq} {arm}"]
            assert [k.removeprefix("Flash") for k in ours["kinds"]] == kinds, (freq, arm, ours["kinds"])
            assert (ours["count"], ours["names"]) == (stock["count"], stock["names"]), (freq, arm)


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


def _rank_env() -> dict:
    """One gloo rank; this checkout first on the path (not whichever copy is installed)."""
    from tests.support.pool import _free_port

    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0", "PYTHONPATH": path,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


@pytest.mark.newest_only
def test_launcher_runs_a_pretrain_script_and_megatron_builds_our_layers(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(PRETRAIN_STAND_IN)
    cfg = ROOT / "configs" / "slicing.yaml"  # not the default: proves the file reached the layers
    cmd = [sys.executable, "-m", "megatron_flashoverlap.launch", str(script), *MEGATRON_ARGS,
           "--flash-overlap", "--flash-overlap-config", str(cfg)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert result["flash_overlap"] is True and result["spec"] == SPEC
    assert result["classes"] == {"qkv": "FlashColumnParallelLinear", "proj": "FlashRowParallelLinear",
                                 "fc1": "FlashColumnParallelLinear", "fc2": "FlashRowParallelLinear"}
    expected = load_config(cfg)
    assert result["plans"] == {k: [expected.plan(k).algo, expected.plan(k).num_chunks] for k in result["plans"]}


@pytest.mark.newest_only
def test_flags_apply_before_megatron_validates(monkeypatch):
    """The patch's provider inside Megatron's real parse_and_validate_args: our message, not the TypeError
    validate_args raises on `args.spec[0]` (arguments.py ~l.435) when the flags came too late."""
    from megatron.training.arguments import parse_and_validate_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGS, "--flash-overlap",
                                      "--attention-backend", "local"])
    with pytest.raises(ValueError, match="--flash-overlap: --attention-backend local .*; drop --attention-backend local"):
        parse_and_validate_args(extra_args_provider=with_flash_overlap_args(None))


# Save a checkpoint's args as Megatron's torch format does (iter_*/mp_rank_00/model_optim_rng.pt holds
# {"args": the parsed Namespace, ...}) from a --flash-overlap run, then, as a new run would, reload them with
# --use-checkpoint-args. Megatron restores args.spec (force=True) from the checkpoint: WITHOUT --flash-overlap
# that must not make the run ours (issue 26 item 7): Megatron's own layers on 0.19's GPTModelBuilder path and
# on the legacy gpt_builder path (GPTModel(transformer_layer_spec=import_module(args.spec)), tools/checkpoint),
# one line saying so; WITH --flash-overlap ours; the parameter names equal in all three.
RELOAD_STAND_IN = '''
import json, os, sys, torch
from megatron.training import checkpointing
from megatron.training.arguments import (parse_args, parse_and_validate_args, core_transformer_config_from_args,
                                         validate_args)
from megatron_flashoverlap import config as fc
from megatron_flashoverlap.megatron.cli.args import with_flash_overlap_args
ckpt, cfg, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = ["pretrain_gpt.py", *argv, "--flash-overlap", "--flash-overlap-config", cfg]
saved = parse_args(with_flash_overlap_args(None))
os.makedirs(f"{ckpt}/iter_0000001/mp_rank_00")
torch.save({"args": saved, "iteration": 1, "checkpoint_version": 3.0}, f"{ckpt}/iter_0000001/mp_rank_00/model_optim_rng.pt")
open(f"{ckpt}/latest_checkpointed_iteration.txt", "w").write("1")
fc.activate(None)  # what a new process starts from

sys.argv = ["pretrain_gpt.py", *argv, "--use-checkpoint-args", "--load", ckpt]
args = parse_and_validate_args(extra_args_provider=with_flash_overlap_args(None))
sys.argv = ["pretrain_gpt.py", *argv, "--use-checkpoint-args", "--load", ckpt, "--flash-overlap"]
flash_args = parse_args(with_flash_overlap_args(None))
checkpointing.load_args_from_checkpoint(flash_args)
validate_args(flash_args, {})

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.spec_utils import import_module
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training.argument_utils import gpt_config_from_args
from megatron.training.models.gpt import GPTModelBuilder
from megatron_flashoverlap.megatron import cpu
cpu.enable()
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)
pgs = ProcessGroupCollection.use_mpu_process_groups()
legacy_spec = import_module(args.spec) if args.spec else get_gpt_layer_local_spec()  # gpt_builder's choice
built = {"builder": GPTModelBuilder(gpt_config_from_args(args)).build_model(pgs),
         "legacy": GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=legacy_spec,
                            vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                            position_embedding_type=args.position_embedding_type),
         "flash": GPTModelBuilder(gpt_config_from_args(flash_args)).build_model(pgs)}
def linears(model):
    layer = model.decoder.layers[0]
    return [type(m).__name__ for m in (layer.self_attention.linear_qkv, layer.self_attention.linear_proj,
                                       layer.mlp.linear_fc1, layer.mlp.linear_fc2)]
print("RESULT " + json.dumps({"spec": args.spec, "flash_overlap": args.flash_overlap, "flash_spec": flash_args.spec,
                              "classes": {k: linears(m) for k, m in built.items()},
                              "keys": {k: sorted(m.state_dict()) for k, m in built.items()}}))
dist.destroy_process_group()
'''


@pytest.mark.newest_only
def test_flash_checkpoint_args_leave_a_stock_run_stock(tmp_path):
    script = tmp_path / "reload.py"
    script.write_text(RELOAD_STAND_IN)
    cmd = [sys.executable, str(script), str(tmp_path / "ckpt"), str(ROOT / "configs" / "slicing.yaml"),
           *MEGATRON_ARGS, "--ckpt-format", "torch"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert result["spec"] is None and result["flash_overlap"] is False  # the checkpoint's spec was not taken
    assert result["flash_spec"] == SPEC
    stock = ["ColumnParallelLinear", "RowParallelLinear"] * 2
    ours = ["FlashColumnParallelLinear", "FlashRowParallelLinear"] * 2
    assert result["classes"] == {"builder": stock, "legacy": stock, "flash": ours}
    assert result["keys"]["builder"] == result["keys"]["legacy"] == result["keys"]["flash"]
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("> --use-checkpoint-args: ")]
    assert len(said) == 1 and "builds Megatron's own layers" in said[0] and "add --flash-overlap" in said[0], said


# --------------------------------------------------------------------------- tier 1: --cpu, options
def test_cpu_defaults_fill_only_what_the_user_left_out():
    argv = launch.cpu_argv(["--num-layers", "2", "--distributed-backend=gloo", "--transformer-impl", "local",
                            "--no-rope-fusion"])
    assert argv[:5] == ["--num-layers", "2", "--distributed-backend=gloo", "--transformer-impl", "local"]
    assert argv.count("--no-rope-fusion") == 1 and "--distributed-backend" not in argv
    assert argv.count("--transformer-impl") == 1
    for flag in ("--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-gelu-fusion",
                 "--no-masked-softmax-fusion"):
        assert flag in argv
    added = launch.cpu_argv([])
    assert added[added.index("--distributed-backend") + 1] == "gloo"
    # the dynamic engine's KV cache in host memory: 1 GB unless the user sizes it
    assert added[added.index("--inference-dynamic-batching-buffer-size-gb") + 1] == "1"
    assert launch.cpu_argv(["--inference-dynamic-batching-buffer-size-gb", "4"]).count(
        "--inference-dynamic-batching-buffer-size-gb") == 1


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


@pytest.mark.newest_only
def test_flag_makes_pretrains_ddp_ours_and_says_when_it_stays_stock(monkeypatch):
    """--flash-overlap puts our DDP subclass under training.py's name (get_model's `DP = DDP`, and
    `DP is DDP` for 0.19's layouts); without the distributed optimizer and overlap_grad_reduce it builds
    stock and names both flags."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.training import training

    from megatron_flashoverlap.megatron.ddp.pretrain import FlashDistributedDataParallel, why_stock

    from megatron.training.models import dist_utils

    monkeypatch.setattr(training, "DDP", training.DDP)  # both restored after the test
    monkeypatch.setattr(dist_utils, "DistributedDataParallel", dist_utils.DistributedDataParallel)
    apply_flash_overlap_args(ns(flash_overlap=True))
    assert training.DDP is dist_utils.DistributedDataParallel is FlashDistributedDataParallel
    assert issubclass(FlashDistributedDataParallel, DistributedDataParallel)
    why = why_stock(DistributedDataParallelConfig(), {})
    assert "--use-distributed-optimizer" in why and "--overlap-grad-reduce" in why
    why = why_stock(DistributedDataParallelConfig(use_distributed_optimizer=True), {})
    assert "--overlap-grad-reduce" in why

