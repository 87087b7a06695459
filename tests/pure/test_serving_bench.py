"""benchmarks/serving/: the load plan and the figures, on hand-written client answers and engine records.

Tier: pure (no processes, no shaping, no server). Times are short decimals chosen so every figure is worked out
by hand beside its assert (TTFT = engine first token - client send; TPOT = (finish - first) / (tokens - 1)).
"""
import pytest

from benchmarks.serving.load import generate_argv, plan, serve_argv
from benchmarks.serving.table import markdown, requests, summarize

CFG = {"layers": 2, "hidden": 64, "heads": 4, "seq": 64, "vocab": 128, "tp": 4, "kv_gb": 0.5, "rates": [1.0, 4.0],
       "requests": 5, "prompt": [4, 24], "output": [4, 12]}


def test_the_plan_is_open_loop_poisson_with_distinct_prompts_and_the_same_for_every_call():
    p = plan(CFG)
    assert p == plan(CFG)  # one seed: every arm and round gets the same requests at the same times
    prompts = [tuple(r["prompt"]) for reqs in p["rates"].values() for r in reqs] + [tuple(p["warmup"]["prompt"])]
    assert len(set(prompts)) == len(prompts) == 11
    for rate, reqs in p["rates"].items():
        at = [r["at"] for r in reqs]
        assert at[0] == 0.0 and at == sorted(at) and len(set(at)) == len(at), (rate, at)
        assert all(4 <= len(r["prompt"]) <= 24 and 4 <= r["max_tokens"] <= 12 for r in reqs)
        assert all(1 <= t <= 126 for r in reqs for t in r["prompt"])  # no 0, no eod (127)


def test_a_plan_that_does_not_fit_the_models_positions_fails_before_any_run():
    with pytest.raises(ValueError, match="exceeds --seq"):
        plan({**CFG, "prompt": [4, 60]})


def test_the_arms_differ_by_the_flag_alone():
    stock, flash = serve_argv("stock", CFG, "/c", 8000), serve_argv("flash", CFG, "/c", 8000)
    assert flash == stock + ["--flash-overlap"] and "--cpu" in stock and stock[stock.index("--port") + 1] == "8000"
    reqs = [{"prompt": [1, 2], "max_tokens": 3}, {"prompt": [5], "max_tokens": 7}]
    argv = generate_argv("stock", CFG, "/c", reqs)
    assert argv[argv.index("--num-tokens-to-generate") + 1] == "7" and argv[-2:] == ["1 2", "5"]
    with pytest.raises(ValueError, match="unknown arm"):
        serve_argv("fast", CFG, "/c", 8000)


def _raw(first_flash: float, tokens_flash: list) -> dict:
    """One rate, two requests: sent at 100.0 and 101.0; stock's first tokens 0.5 s after the send, 3 tokens
    0.2 s apart; flash's first token `first_flash` s after, 0.1 s apart."""
    p = {"rates": {"1.0": [{"id": 0, "at": 0.0, "prompt": [1, 2], "max_tokens": 3},
                           {"id": 1, "at": 1.0, "prompt": [3, 4], "max_tokens": 3}]}}

    def run(first: float, step: float, tokens: list) -> dict:
        client = [{"id": i, "sent": 100.0 + i, "done": 100.0 + i + first + 2 * step + 0.25, "tokens": tokens,
                   "error": None} for i in range(2)]
        engine = [{"prompt": q["prompt"], "tokens": tokens, "added": 100.1 + i, "first": 100.0 + i + first,
                   "finish": 100.0 + i + first + 2 * step} for i, q in enumerate(p["rates"]["1.0"])]
        return {"client": {"1.0": client}, "engine": engine}
    return {"plan": p, "runs": {"stock": [run(0.5, 0.2, [7, 8, 9])], "flash": [run(first_flash, 0.1, tokens_flash)]},
            "offline": {"stock": [{"seconds": 2.0, "tokens": 10, "requests": [[1], [2]]}],
                        "flash": [{"seconds": 1.0, "tokens": 10, "requests": [[1], [3]]}]}}


def test_ttft_tpot_and_end_to_end_per_request():
    got = requests(_raw(0.25, [7, 8, 9])["plan"], _raw(0.25, [7, 8, 9])["runs"]["stock"][0], "1.0")
    assert [r["ttft"] for r in got] == [0.5, 0.5]
    assert [r["tpot"] for r in got] == pytest.approx([0.2, 0.2], abs=1e-12)  # (finish - first) / (3 - 1)
    assert [r["e2e"] for r in got] == pytest.approx([0.5 + 0.4 + 0.25] * 2, abs=1e-12)


def test_summary_ratios_and_same_tokens():
    s = summarize(_raw(0.25, [7, 8, 9]))["1.0"]
    assert s["vs"]["ttft"]["ratio"] == pytest.approx(2.0)  # 0.5 / 0.25
    assert s["vs"]["tpot"]["ratio"] == pytest.approx(2.0)  # 0.2 / 0.1
    assert s["same"] == (2, 2)
    # tokens/s: 6 tokens from the first send (100.0) to the last answer (101.0 + 0.5 + 0.4 + 0.25)
    assert s["tps"]["stock"] == pytest.approx(6 / 2.15)
    assert summarize(_raw(0.25, [7, 8, 1]))["1.0"]["same"] == (0, 2)


def test_the_tables_state_the_offline_throughput_and_identical_requests():
    md = markdown(_raw(0.25, [7, 8, 9]))
    assert "| stock | 5.0 | 2.0 | 2/2 |" in md  # 10 tokens / 2 s; stock against itself
    assert "| flash | 10.0 | 1.0 | 1/2 |" in md  # second request differs
    assert "| 1.0 | 2.00x" in md
