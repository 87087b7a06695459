"""The README's main job (examples/train_tiny_gpt.py), short: a real Megatron-Core GPTModel, TP=2 + sequence
parallel on 2 gloo CPU ranks, local spec vs flashoverlap_layer_spec from the same weights on the same batches.
Tier 2 (2 processes: the session pool). Asserts the curves match, never timing."""
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples import train_tiny_gpt  # noqa: E402

# TP=2: every reduce-scatter / all-reduce sums two partials, and a+b == b+a in fp32, so the curves are
# expected to be identical; 1e-5 relative leaves room for the BLAS picking another kernel for the
# sliced GEMMs (different row counts), which reorders the dot-product sums.
RTOL = 1e-5
STEPS = 4


def test_example_curves_match(pools, tmp_path, capsys):
    plot, js = tmp_path / "curves.png", tmp_path / "curves.json"
    out = train_tiny_gpt.main(["--steps", str(STEPS), "--plot", str(plot), "--json", str(js),
                                "--verbose"],  # --verbose: leave the shared pool's log levels alone
                               pool=pools(2))
    printed = capsys.readouterr().out
    assert out["init_equal"], "both arms must start from the same weights"
    assert out["sites"] == {s: "flash" for s in ("fc1", "fc2", "proj", "qkv")}, out["sites"]  # ours ran
    local, flash = out["loss_local"], out["loss_flash"]
    assert len(local) == len(flash) == STEPS and all(math.isfinite(x) for x in local + flash)
    for a, b in zip(local, flash):
        assert abs(a - b) <= RTOL * abs(a), (a, b)
    assert local[-1] < local[0], "the synthetic task is learnable: the loss must fall"
    assert plot.stat().st_size > 0 and json.loads(js.read_text())["max_diff"] <= RTOL * max(local)
    assert f"{STEPS:4d}  {local[-1]:10.5f}  {flash[-1]:10.5f}" in printed  # the side-by-side table
    assert f"plot: {plot}" in printed
