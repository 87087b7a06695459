"""flashoverlap-plan's command line: argument parsing, the JSON shapes, the emitted YAML, the refusals.

Tier: pure (no processes: cli.main is called in-process; seconds). No timing is asserted.
"""
import json
import pathlib
import sys
import tomllib

import pytest

from megatron_flashoverlap.config import load_config
from megatron_flashoverlap.plan import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
OP_KEYS = {"reference_ms", "slicing_ms", "flash_ms", "bound_ms"}
GPT = ["--hidden-size", "4096", "--num-attention-heads", "32", "--num-query-groups", "8", "--seq-length", "4096",
       "--num-layers", "32", "--ffn-hidden-size", "14336", "--swiglu", "--global-batch-size", "64"]


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_op_form_prints_the_four_numbers(capsys, op):
    rc, out, _ = run(capsys, "op", "--op", op, "--m", "16384", "--k", "8192", "--n", "28672", "--tp", "8",
                     "--gpu", "h100", "--dtype", "bf16", "--json")
    data = json.loads(out)
    assert rc == 0 and set(data) == OP_KEYS
    assert all(isinstance(v, float) and v > 0 for v in data.values())
    assert data["bound_ms"] <= min(data["reference_ms"], data["flash_ms"])  # the bound is a lower bound


def test_op_form_all_reduce_across_nodes(capsys):
    rc, out, _ = run(capsys, "op", "--op", "all_reduce", "--bytes", "262144", "--tp", "16", "--nodes", "2",
                     "--gpu", "h100", "--json")
    data = json.loads(out)
    assert rc == 0 and set(data) == OP_KEYS
    assert data["slicing_ms"] == data["reference_ms"]  # nothing to slice under: slicing is the reference


def test_op_form_refusals(capsys):
    rc, _, err = run(capsys, "op", "--op", "all_reduce", "--tp", "8", "--gpu", "h100", "--json")
    assert rc == 2 and "--bytes" in err
    rc, _, err = run(capsys, "op", "--op", "all_gather_matmul", "--m", "8", "--tp", "8", "--gpu", "h100")
    assert rc == 2 and "--k" in err
    rc, _, err = run(capsys, "op", "--op", "all_gather_matmul", "--m", "8", "--k", "8", "--n", "8", "--tp", "8",
                     "--gpu", "tpu")
    assert rc == 2 and "--gpu 'tpu'" in err and "h100" in err
    rc, _, err = run(capsys, "op", "--op", "all_reduce", "--bytes", "8", "--tp", "6", "--nodes", "4", "--gpu", "h100")
    assert rc == 2 and "tp / nodes" in err
    with pytest.raises(SystemExit):
        cli.main(["op", "--op", "all_to_all", "--tp", "8"])


def test_main_form_json(capsys):
    rc, out, _ = run(capsys, *GPT, "--tensor-model-parallel-size", "8", "--sequence-parallel", "--gpu", "h100",
                     "--nodes", "2", "--json")
    data = json.loads(out)
    assert rc == 0 and data["label"] == "prediction"
    assert set(data["sites"]) == {"qkv", "proj", "fc1", "fc2"}
    for site in data["sites"].values():
        assert {"choice", "stock_ms", "ours_ms", "exposed_stock_ms", "exposed_ours_ms", "why"} <= set(site)
        assert site["choice"] in site["variants_ms"] and site["why"]
    assert set(data["step_s"]) == {"stock", "flash_overlap"} and data["inputs"]["data_parallel_size"] is None
    assert data["microbatches"] == 32  # 2 nodes x 8 GPUs / TP 8 = DP 2; global 64 / (micro 1 x DP 2)
    assert data["dp"]["fuse"] in (True, False) and "decode_all_reduce" in data


def test_main_form_text_says_prediction_and_why(capsys):
    rc, out, _ = run(capsys, *GPT, "--tensor-model-parallel-size", "4", "--gpu", "a100", "--gpus-per-node", "4")
    assert rc == 0 and "PREDICTION" in out and "TP=4 (no SP)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line[:4] in ("qkv ", "proj", "fc1 ", "fc2 ")}
    assert set(lines) == {"qkv", "proj", "fc1", "fc2"} and all("exposed" in v for v in lines.values())


@pytest.mark.parametrize("gpu, micro, algo", [("h800", "4", "flash"), ("a100", "1", "slicing")])
def test_emit_config_loads_with_the_flag_loader(capsys, tmp_path, gpu, micro, algo):
    path = tmp_path / "plan.yaml"
    rc, out, _ = run(capsys, *GPT, "--tensor-model-parallel-size", "8", "--sequence-parallel", "--gpu", gpu,
                     "--micro-batch-size", micro, "--json", "--emit-config", str(path))
    data, cfg = json.loads(out), load_config(path)
    assert rc == 0
    assert algo in {e["choice"].split(":")[0] for e in data["sites"].values()}  # the case exercises that knob
    for site, entry in data["sites"].items():
        plan = cfg.plan(site)
        algo, _, knob = entry["choice"].partition(":")
        assert plan.algo == algo
        assert plan.num_chunks == (int(knob) if algo == "slicing" else None)
        assert plan.hop_chunks == (int(knob) if algo == "flash" and int(knob or 1) > 1 else None)
    assert cfg.dp.fuse == ("all" if data["dp"]["fuse"] else "none")


def test_emit_config_without_sp_sets_the_all_reduce_chunks(capsys, tmp_path):
    # a 50 GB/s link (a user link from --hardware) beside h=8192 GEMMs: the all-reduce is worth decomposing
    # somewhere (checked: the case must exercise the setting), and every flash site shares one chunk count
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"links": {"slow": {"gbps": 50.0, "coll_efficiency": 0.8, "p2p_efficiency": 0.8,
                                                 "base_lat_us": [3.6, 10.0, 8.4], "hop_lat_us": [1.0, 2.5, 5.7],
                                                 "p2p_us": 12.0}}}))
    path = tmp_path / "plan.yaml"
    big = ["--hidden-size", "8192", "--num-attention-heads", "64", "--num-query-groups", "8", "--seq-length", "8192",
           "--num-layers", "32", "--ffn-hidden-size", "28672", "--swiglu"]
    rc, out, _ = run(capsys, *big, "--tensor-model-parallel-size", "8", "--gpu", "h100", "--intra-node", "slow",
                     "--hardware", str(hw), "--json", "--emit-config", str(path))
    data, cfg = json.loads(out), load_config(path)
    flash = {e["choice"] for e in data["sites"].values() if e["choice"].startswith("flash:")}
    assert rc == 0 and len(flash) == 1  # all_reduce.num_chunks is one setting for every site
    assert cfg.all_reduce.num_chunks == int(flash.pop().split(":")[1])


def test_main_form_refusals(capsys):
    rc, _, err = run(capsys, *GPT, "--tensor-model-parallel-size", "8", "--data-parallel-size", "4", "--nodes", "2",
                     "--gpu", "h100")
    assert rc == 2 and "--nodes" in err
    rc, _, err = run(capsys, *GPT, "--tensor-model-parallel-size", "3", "--gpu", "h100", "--data-parallel-size", "1",
                     "--gpus-per-node", "3")
    assert rc == 2 and "--num-attention-heads" in err
    with pytest.raises(SystemExit):  # a required Megatron argument missing
        cli.main(["--hidden-size", "1024"])


def test_timeline_draws_or_says_what_is_missing(capsys, tmp_path, monkeypatch):
    png = tmp_path / "layer.png"
    args = [*GPT, "--tensor-model-parallel-size", "8", "--sequence-parallel", "--gpu", "h100", "--timeline", str(png)]
    pytest.importorskip("matplotlib")
    assert run(capsys, *args)[0] == 0 and png.stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit, match="needs matplotlib"):
        cli.main(args)


def test_the_entry_points():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["flashoverlap-plan"] == "megatron_flashoverlap.plan.cli:main"
    assert (ROOT / "megatron_flashoverlap" / "plan" / "__main__.py").read_text().count("main()") == 1


def test_sixteen_thousand_gpus(capsys):
    # 2048 nodes x 8: the DP ring of 2048 ranks is walked step by step (no timing asserted)
    rc, out, _ = run(capsys, *GPT, "--tensor-model-parallel-size", "8", "--sequence-parallel", "--gpu", "b200",
                     "--nodes", "2048", "--global-batch-size", "4096", "--inter-node", "ib_xdr", "--json")
    assert rc == 0 and json.loads(out)["inputs"]["nodes"] == 2048


def test_the_planner_does_not_import_torch():
    """The CLI answers on a laptop without torch: neither the planner nor the package root imports it
    (the root's operator names load on first use). A fresh interpreter, so nothing is imported already."""
    import subprocess

    code = ("import sys, megatron_flashoverlap.plan.cli, megatron_flashoverlap; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    root = pathlib.Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={"PYTHONPATH": str(root)}, timeout=120)
