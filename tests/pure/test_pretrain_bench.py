"""benchmarks/pretrain/run.py's parsing, statistic and tables on hand-written Megatron logs.

Tier: pure (no processes, no shaping). The log lines copy the format Megatron-Core 0.19's training_log and
Timers.log print (an iteration line on the last rank, then "(min, max) time across ranks (ms):" and one
line per timer; rank 0 prints our "GEMM sites:" line). Expected values are worked out by hand beside each
assert; every figure is a short decimal, so medians and ratios are compared exactly or to 1e-12 where a
division rounds.
"""
import argparse
import os

import pytest

from benchmarks.pretrain.profiling import OTHER, categorize_events, profile_argv, profile_table
from benchmarks.pretrain.table import breakdown_table, loss_table, summarize, table
from benchmarks.harness.launch import HEAP, _env
from benchmarks.pretrain.rows import ARMS, entry_argv, heap_kept, merge, parse_log, run_stat
from megatron_flashoverlap.config import load_config
from megatron_flashoverlap.megatron.cli.args import add_flash_overlap_args

CFG = {"layers": 2, "hidden": 1024, "heads": 16, "seq": 1024, "mbs": 1, "iters": 4, "vocab": 128}


def _log(ms: list[float], loss: list[float], fwd: list[float]) -> str:
    """The last rank's output of one run: set-up timers, then per iteration a log line and its timers."""
    lines = ["INFO:megatron.core.timers:(min, max) time across ranks (ms):",
             "    model-and-optimizer-setup ......................: (94.52, 94.92)"]
    for i, (t, l, f) in enumerate(zip(ms, loss, fwd), start=1):
        lines += [f" [2026-12-01 11:30:13.386239] iteration        {i}/       {len(ms)} | consumed samples: "
                  f"           {i} | elapsed time per iteration (ms): {t:.1f} | learning rate: 8.333333E-05 | "
                  f"global batch size:     1 | lm loss: {l:.6E} | loss scale: 1.0 | grad norm: 6.185 | "
                  f"number of skipped iterations:   0 | number of nan iterations:   0 |",
                  "WARNING:megatron.core.tensor_parallel.random:CPU RNG state changed within GPU RNG context",
                  "INFO:megatron.core.timers:(min, max) time across ranks (ms):",
                  f"    forward-backward ...............................: ({t - 60:.2f}, {t - 50:.2f})",
                  f"    forward-compute ................................: ({f - 1:.2f}, {f:.2f})",
                  "    optimizer ......................................: (45.49, 45.97)"]
    return "\n".join(lines) + "\n"


def _run(ms, loss=(5.0, 4.0, 3.0, 2.0), fwd=(600.0, 500.0, 400.0, 300.0), sites="fc1=flash, qkv=flash"):
    rank0 = parse_log(f"noise\nGEMM sites: {sites}\n")
    return merge([rank0, parse_log(_log(list(ms), list(loss), list(fwd)))])


def test_parse_log_reads_iterations_losses_timers_and_sites():
    p = _run([3000.0, 2000.0, 1000.0, 1500.0])
    assert p["iters"] == {1: 3000.0, 2: 2000.0, 3: 1000.0, 4: 1500.0}
    assert p["loss"] == {1: 5.0, 2: 4.0, 3: 3.0, 4: 2.0}
    assert p["timers"][0] == {"model-and-optimizer-setup": 94.92}  # set-up: before iteration 1, max kept
    assert p["timers"][3] == {"forward-backward": 950.0, "forward-compute": 400.0, "optimizer": 45.97}
    assert p["sites"] == "fc1=flash, qkv=flash"


def test_run_stat_is_the_median_after_warmup():
    p = _run([3000.0, 2000.0, 1000.0, 1500.0])
    assert run_stat(p, 1) == 1.5  # iterations 2, 3, 4: 2000, 1000, 1500 ms -> median 1500 ms
    assert run_stat(p, 2) == 1.25  # iterations 3, 4: (1000 + 1500) / 2 ms
    with pytest.raises(ValueError, match="raise --iters above --warmup"):
        run_stat(p, 4)


def test_summarize_speedup_loss_diff_and_comm_share():
    # 3 rounds; per-run medians after warmup 1 (iterations 2-4): stock 2000, 2100, 1900; flash 1000 in each
    stock = [_run([9000, 2000, 2000, 2000]), _run([9000, 2100, 2100, 2100]), _run([9000, 1900, 1900, 1900])]
    flash = [_run([9000, 1000, 1000, 1000], loss=(5.0, 4.0, 3.0, 2.5))] * 3
    fast = [_run([9000, 1500, 1500, 1500])] * 3
    s = summarize({"stock": stock, "flash": flash, "stock@unshaped": fast}, warmup=1)
    f = s["arms"]["flash"]
    assert f["median"] == 1.0 and s["arms"]["stock"]["median"] == 2.0
    assert f["vs_stock"]["ratio"] == 2.0  # median stock 2000 / median flash 1000
    assert f["vs_stock"]["win"] and 1.9 / 1.0 <= f["vs_stock"]["ci"][0] <= f["vs_stock"]["ci"][1] <= 2.1
    assert s["max_loss_diff"] == {"stock": 0.0, "flash": 0.5, "stock@unshaped": 0.0}  # iteration 4: 2.5 vs 2
    assert s["comm"]["fraction"] == pytest.approx(0.25, abs=1e-12)  # 1 - 1500 / 2000
    assert f["phases"]["forward-compute"] == 400.0  # iterations 2-4: 500, 400, 300 -> median 400
    assert f["sites"] == "fc1=flash, qkv=flash"


def test_tables_show_every_arm_and_the_verdict():
    stock = [_run([9000, 2000, 2000, 2000])] * 2
    flash = [_run([9000, 1000, 1000, 1000])] * 2
    slicing = [_run([9000, 2000, 2000, 2000], sites="fc1=slicing")] * 2
    s = summarize({"stock": stock, "flash": flash, "slicing": slicing}, warmup=1)
    t = table(s, "1gbit")
    assert "| flash | 1gbit | 1000 (1000-1000) | 2 | 2.00x [2.00, 2.00] win | 0.0e+00 | fc1=flash, qkv=flash |" in t
    assert "| slicing | 1gbit | 2000 (2000-2000) | 2 | 1.00x [1.00, 1.00] tie |" in t  # equal: no claim
    assert "Communication share" not in t  # no stock@unshaped arm, no share
    assert "| flash | 950 | 400 | 46 | 1000 |" in breakdown_table(s)  # fwd-bwd max 1000 - 50; fwd 500, 400, 300
    assert loss_table(s).splitlines()[2] == "| 1 | 5.000000 | 5.000000 | 5.000000 |"


def test_a_heap_arm_runs_its_base_arms_flags_with_the_heap_kept_and_compares_with_stock_heap():
    assert entry_argv("auto+b60+heap", CFG) == entry_argv("auto+b60", CFG)
    assert heap_kept("auto+b60+heap") and not heap_kept("auto+b60")
    assert set(HEAP) == {"MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_"}  # glibc's names (a typo is ignored by glibc)
    kept, default = _env(None, "/r", heap=True), _env(None, "/r", heap=False)
    assert all(kept[k] == v for k, v in HEAP.items()) and kept["OMP_NUM_THREADS"] == "1"
    assert not any(k in default and default[k] == v for k, v in HEAP.items())
    with pytest.raises(ValueError, match="each also as <arm>[+]heap"):
        entry_argv("nonsense+heap", CFG)
    stock = [_run([9000, 2000, 2000, 2000])] * 2
    heap = [_run([9000, 1600, 1600, 1600])] * 2
    flash_heap = [_run([9000, 800, 800, 800])] * 2
    s = summarize({"stock": stock, "stock+heap": heap, "flash+heap": flash_heap}, warmup=1)
    assert s["arms"]["stock+heap"]["vs_stock"]["ratio"] == 1.25  # the heap's own effect: against stock
    assert s["arms"]["flash+heap"]["vs_stock"]["ratio"] == 2.0  # 1600 / 800: against stock+heap, not 2000 / 800
    t = table(s, "1gbit")
    assert "| flash+heap | 1gbit | 800 (800-800) | 2 | 2.00x [2.00, 2.00] win (vs stock+heap) |" in t
    # without stock+heap in the run, a heap arm compares with stock (and says nothing else)
    s = summarize({"stock": stock, "flash+heap": flash_heap}, warmup=1)
    assert s["arms"]["flash+heap"]["vs_stock"]["ratio"] == 2.5 and "(vs" not in table(s, "1gbit")
    # a run of heap arms alone: stock+heap is the reference (its loss curve too)
    s = summarize({"stock+heap": heap, "flash+heap": flash_heap}, warmup=1)
    assert s["arms"]["stock+heap"]["vs_stock"] is None and s["arms"]["flash+heap"]["vs_stock"]["ratio"] == 2.0
    assert "2.00x [2.00, 2.00] win (vs stock+heap)" in table(s, "1gbit") and loss_table(s)
    with pytest.raises(ValueError, match="keep one of them in --arms"):
        summarize({"flash+heap": flash_heap}, warmup=1)


def _chose(pick: str, word: str) -> str:
    """plan/chooser.py's decision line as the logging module prints it."""
    return (f"WARNING:megatron_flashoverlap.ops.choose:flash-overlap chose {pick} for {word} (2 ranks, 1 per node, "
            f"gloo, float32; w 3072x1024 x 1024): measured, {pick} faster than stock in 5/5 paired rounds "
            f"[reference 11000 us, flash 9000 us]")


def test_the_choosers_picks_are_counted_per_key_over_the_runs():
    def auto(qkv: str) -> dict:
        rank0 = parse_log(f"GEMM sites: qkv=auto, fc1=auto\n{_chose(qkv, 'qkv/train/1024')}\n"
                          f"{_chose('flash', 'fc1/train/1024')}\n")
        return merge([rank0, parse_log(_log([9000, 1000, 1000, 1000], [5.0, 4.0, 3.0, 2.0], [1.0] * 4))])
    assert auto("reference")["picks"] == {"qkv/train/1024": "reference", "fc1/train/1024": "flash"}
    stock = [_run([9000, 2000, 2000, 2000])] * 3
    s = summarize({"stock": stock, "auto": [auto("flash"), auto("reference"), auto("flash")]}, warmup=1)
    assert s["arms"]["auto"]["picks"] == {"qkv/train/1024": {"flash": 2, "reference": 1},
                                          "fc1/train/1024": {"flash": 3}}
    assert s["arms"]["stock"]["picks"] == {}  # no auto site: no line for it
    assert ("- auto, the chooser's picks over 3 runs: fc1/train/1024 flash 3; qkv/train/1024 flash 2, reference 1"
            in table(s, "1gbit"))
    assert "- stock," not in table(s, "1gbit")


def test_summarize_refuses_no_stock_and_mismatched_iterations():
    with pytest.raises(ValueError, match="keep one of them in --arms"):
        summarize({"flash": [_run([1, 2, 3, 4])]}, warmup=1)
    short = merge([parse_log(_log([9000, 1000], [5.0, 4.0], [1.0, 1.0]))])
    with pytest.raises(ValueError, match="same --iters"):
        summarize({"stock": [_run([9000, 2000, 2000, 2000])], "flash": [short]}, warmup=1)


def test_arms_use_the_real_flags_and_configs():
    parser = add_flash_overlap_args(argparse.ArgumentParser())
    for arm, (flags, _link) in ARMS.items():
        argv = entry_argv(arm, CFG)
        assert argv[0] == "--cpu" and "--sequence-parallel" in argv and argv[argv.index("--seq-length") + 1] == "1024"
        args, _ = parser.parse_known_args(argv)  # the flags as the entry gets them
        assert args.flash_overlap == ("--flash-overlap" in flags)
        assert args.flash_overlap_config is None or os.path.isfile(args.flash_overlap_config)
    assert ARMS["slicing"][0][-1].endswith("configs/slicing.yaml")
    keep = load_config(entry_argv("flash+keep", CFG)[-1])  # the YAML the arm writes loads, with the knob set
    assert keep.plan("qkv").keep_gathered and keep.plan("fc1").keep_gathered and not keep.plan("proj").keep_gathered
    for arm in ("flash+c2+qsplit", "auto+qsplit"):  # query split on, each with its algo at the other sites
        qsplit = load_config(entry_argv(arm, CFG)[-1])
        assert qsplit.attention.query_split and qsplit.plan("fc1").algo == arm.split("+")[0]
    budget = load_config(entry_argv("auto+b60", CFG)[-1])  # the default chooser, only its budget raised
    assert budget.choices.budget_s == 60 and budget.plan("proj").algo == "auto" and budget.attention.query_split == "auto"
    assert "--attention-dropout" not in entry_argv("stock", CFG)  # Megatron's default unless given
    argv = entry_argv("stock", {**CFG, "attention_dropout": 0.0})
    assert argv[argv.index("--attention-dropout") + 1] == "0.0"
    with pytest.raises(ValueError, match="choose among"):
        entry_argv("fast", CFG)


def _x(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_profile_categories_claim_each_instant_once():
    # two profiled steps of 100 us each on thread 1: [0, 100) and [200, 300); times in us, results in ms
    events = [_x("ProfilerStep#3", 0, 100), _x("ProfilerStep#4", 200, 100),
              _x("AllGatherMatmul", 10, 30),  # ours: 10-40
              _x("aten::mm", 12, 5),  # a GEMM slice inside ours: ours, not a wait
              _x("c10d::allgather_", 20, 10),  # inside ours: already claimed, counts as ours
              _x("c10d::allreduce_", 50, 20),  # a free collective: 20
              _x("Optimizer.step#AdamW.step", 280, 40),  # runs past the window: only 280-300 counts
              _x("autograd::engine::evaluate_function: MatmulReduceScatterBackward", 210, 20),  # ours: 20
              _x("MatmulReduceScatterBackward", 212, 10),  # nested in the one above: no double count
              _x("AllGatherMatmul", 400, 50),  # outside every profiled step: ignored
              _x("aten::mm", 0, 100, tid=2)]  # another thread (the communication thread): ignored
    out = categorize_events(events)
    ms = out["ms"]
    assert out["steps"] == 2 and out["step_ms"] == 0.1  # 200 us over 2 steps
    assert ms["flash TP linears (ours)"] == 0.025  # (30 + 20) us / 2 steps
    assert out["wait_ms"]["flash TP linears (ours)"] == 0.0225  # (50 - 5 us in aten::mm) / 2 steps
    assert ms["other collectives (grad sync, grad norm, loss, barriers)"] == 0.01  # 20 us / 2
    assert ms["optimizer step"] == 0.01  # 20 us / 2
    assert ms[OTHER] == pytest.approx(0.1 - 0.025 - 0.01 - 0.01, abs=1e-12)  # the rest of each step
    table_ = profile_table({"flash": out})
    assert "| flash TP linears (ours) | 0 (0) |" in table_ and "| **profiled iteration** | 0 |" in table_


def test_profile_refuses_a_trace_without_steps_and_bad_iterations():
    with pytest.raises(ValueError, match="profile-step-start"):
        categorize_events([_x("aten::mm", 0, 10)])
    with pytest.raises(ValueError, match="1 <= start < end"):
        profile_argv("/tmp/x", 3, 3)
    argv = profile_argv("/tmp/x", 3, 5)
    assert argv[argv.index("--profile-step-start") + 1] == "3" and "--use-pytorch-profiler" in argv
