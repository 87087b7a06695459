"""Tier 1 (pure): the one chooser (plan/chooser.py): its rule, its precedence, its tables and its file.

Nothing runs a collective: samples are given as the max over a group's ranks would hand them in.
"""
import json

import pytest

from megatron_flashoverlap import config
from megatron_flashoverlap.plan import chooser as ch
from megatron_flashoverlap.tools.calibrate_allreduce import write

ROWS = [{"bytes": b, "stock_us": 100.0, "ring_us": 90.0, "recursive_doubling_us": 10.0, "hierarchical_us": 50.0}
        for b in (8, 1 << 20)]
LAYOUT = ch.layout_word(4, 2, "gloo", "float32")
AUTO = {"all_reduce": {"prefill": "auto"}}  # the prefill site measured (its default is stock)


def _entry(backend="gloo", dtype="float32", world=4, local=2, rows=ROWS):
    return {"world_size": world, "local_world_size": local, "backend": backend, "dtype": dtype, "rows": rows}


def _decode(bucket=4, layout=LAYOUT):
    return ch.Key(ch.DECODE_SITE, "decode", bucket, layout, "h 8", (0, 1, 2, 3), 64)  # 64 bytes: inside ROWS


def _prefill(site="proj", kind="prefill", bucket=16, layout=LAYOUT):
    return ch.Key(site, kind, bucket, layout, "h 8 k 4")



def test_buckets_are_powers_of_two():
    assert [ch.bucket(n) for n in (0, 1, 2, 3, 4, 5, 17, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 32, 1024, 2048]


def test_stock_wins_unless_a_candidate_wins_the_paired_rounds():
    stock = [10.0] * 5
    assert ch.paired_pick({"reference": stock, "ring": [9.0, 9.0, 9.0, 11.0, 11.0]})[0] == "reference"  # 3 of 5
    assert ch.paired_pick({"reference": stock, "ring": [9.0, 9.0, 9.0, 9.0, 11.0]})[0] == "ring"  # 4 of 5
    assert ch.paired_pick({"reference": stock, "ring": [9.0, 9.0, 9.0, 9.0, 11.0],
                           "recursive_doubling": [5.0] * 5})[0] == "recursive_doubling"  # the fastest of the others
    assert ch.paired_pick({"reference": stock, "ring": list(stock)})[0] == "reference"  # a tie is stock's
    # a candidate that loses (the slower one) is never taken, however the rounds fall
    assert ch.paired_pick({"reference": [1.0, 1.0, 1.0, 1.0, 1.0], "decomposed": [2.0] * 5})[0] == "reference"


def test_a_sure_gain_runs_where_the_fastest_by_median_is_within_the_noise():
    """proj's pair: query_split lowest by median but faster than stock in 3 of 5 rounds (the attention's noise
    inside its samples), flash_c2 faster in 5 of 5: flash_c2 runs, not stock."""
    stock = [10.0] * 5
    samples = {"reference": stock, "query_split": [5.0, 5.0, 5.0, 11.0, 11.0], "flash": [9.5] * 5,
               "flash_c2": [9.0] * 5}
    pick, why = ch.paired_pick(samples)
    assert pick == "flash_c2" and "query_split, won 3/5" in why, why
    # among the candidates that beat stock, the lowest median: flash at 8.0 over flash_c2 at 9.0
    assert ch.paired_pick({**samples, "flash": [8.0] * 5})[0] == "flash"
    # none beats stock in 4 of 5 rounds: stock, whatever the medians
    assert ch.paired_pick({"reference": stock, "query_split": [5.0, 5.0, 5.0, 11.0, 11.0],
                           "flash": [9.0, 9.0, 9.0, 11.0, 11.0]})[0] == "reference"


def test_a_calibration_table_is_read_by_the_same_rule():
    row = {"bytes": 1024, "reference_us": 10.0, "ring_us": 9.0,
           "reference_rounds_us": [10.0] * 5, "ring_rounds_us": [9.0, 9.0, 9.0, 11.0, 11.0]}
    assert ch.best_at({"rows": [row]}, 1024) is None  # 3 of 5 paired wins
    row["ring_rounds_us"] = [9.0, 9.0, 9.0, 9.0, 11.0]
    assert ch.best_at({"rows": [row]}, 1024) == "ring"  # 4 of 5
    del row["ring_rounds_us"]
    assert ch.best_at({"rows": [row]}, 1024) == "ring"  # an older file keeps medians only: the median decides
    assert ch.best_at({"rows": [row]}, 1 << 20) is None  # outside the measured sizes: no extrapolation


def test_a_table_steers_only_its_own_backend_dtype_and_layout(tmp_path):
    path = tmp_path / "cal.json"
    old = _entry(rows=ROWS)
    del old["backend"], old["dtype"]  # an entry without backend or dtype is never used
    path.write_text(json.dumps({"tables": [_entry(), old]}))
    c = ch.chooser_of(config.from_dict({"all_reduce": {"table": str(path)}}, config.Environment()))
    assert c.answer(_decode()).pick == "recursive_doubling"
    for other in (ch.layout_word(4, 2, "nccl", "float32"), ch.layout_word(4, 2, "gloo", "bfloat16"),
                  ch.layout_word(4, 4, "gloo", "float32"), ch.layout_word(8, 2, "gloo", "float32")):
        got = c.answer(_decode(layout=other))
        assert (got.pick, got.source) == ("reference", "model") and "no entry" in got.reason, other


def test_the_precedence_yaml_then_pinned_then_measured_then_model():
    env = config.Environment()
    pinned = {"layout": LAYOUT, "pinned": {"proj/prefill/16": "decomposed", "all_reduce/decode/4": "ring"}}
    c = ch.chooser_of(config.from_dict({**AUTO, "choices": pinned}, env))
    assert (c.answer(_prefill()).pick, c.answer(_prefill()).source) == ("decomposed", "pinned")
    assert c.answer(_decode()).pick == "ring"
    assert c.answer(_prefill(bucket=32)) is None  # not pinned: the caller measures
    got = c.decide(_prefill(bucket=32), ch.Measured.of({"reference": [1.0] * 5, "decomposed": [2.0] * 5}))
    assert (got.pick, got.source) == ("reference", "measured") and c.answer(_prefill(bucket=32)) is got
    yaml = ch.chooser_of(config.from_dict({"choices": pinned, "all_reduce": {"decode": "recursive_doubling",
                                                                            "prefill": "reference"}}, env))
    assert (yaml.answer(_decode()).pick, yaml.answer(_decode()).source) == ("recursive_doubling", "yaml")
    assert yaml.answer(_prefill()).pick == "reference"  # the user's word beats the pinned file
    assert c.fallback(_prefill(bucket=64), "budget").pick == "reference"  # the model without figures: stock


def test_a_training_site_not_measured_takes_the_planners_pick_where_it_is_a_candidate():
    """The model tier of an auto layer (budget spent, or a CUDA-graph capture): the planner's site pick
    (megatron/probe.py) where it is reference or flash, else stock; decode keys keep their table."""
    c = ch.chooser_of(config.from_dict({}, config.Environment()))
    key = ch.Key("fc2", "train", 4096, LAYOUT, "w 8x4 x 4")
    assert (c.fallback(key, "budget").pick, c.fallback(key, "budget").source) == ("reference", "model")
    c = ch.chooser_of(config.from_dict({}, config.Environment()))
    c.model_sites = {"fc2": {"algo": "flash"}, "qkv": {"algo": "slicing", "num_chunks": 4}}
    got = c.fallback(key, "budget")
    assert (got.pick, got.source) == ("flash", "model") and "planner" in got.reason
    assert c.fallback(ch.Key("qkv", "train", 4096, LAYOUT, "w 8x4 x 4"), "budget").pick == "reference"  # not a candidate
    assert c.fallback(_decode(), "budget").pick == "reference"  # no predicted decode table


def test_a_pinned_file_from_another_layout_is_refused():
    c = ch.chooser_of(config.from_dict({**AUTO, "choices": {"layout": LAYOUT, "pinned": {"proj/prefill/16": "decomposed"}}},
                                       config.Environment()))
    with pytest.raises(ValueError, match="was written for"):
        c.answer(_prefill(layout=ch.layout_word(8, 8, "nccl", "bfloat16")))


def test_the_budget_is_charged_the_measured_seconds():
    c = ch.chooser_of(config.from_dict({**AUTO, "choices": {"budget_s": 1.0}}, config.Environment()))
    assert c.can_measure()
    c.decide(_prefill(), ch.Measured.of({"reference": [0.3] * 2, "decomposed": [0.3] * 2}))
    assert not c.can_measure() and c.spent_s == pytest.approx(1.2)
    wide = ch.chooser_of(config.from_dict({**AUTO, "choices": {"budget_s": 4.0}}, config.Environment()))
    # 1.2 s at 16 tokens
    wide.decide(_prefill(bucket=16), ch.Measured.of({"reference": [0.3] * 2, "decomposed": [0.3] * 2}))
    assert wide.can_measure(_prefill(bucket=32))  # about 2.4 s more: 3.6 s inside 4 s
    assert not wide.can_measure(_prefill(bucket=64))  # about 4.8 s more: the bucket is not started
    # another site: scaled from the costliest per token on the layout (proj's 1.2 s at 16 tokens)
    assert not wide.can_measure(_prefill("fc2", bucket=64)) and wide.can_measure(_prefill("fc2", bucket=16))
    other = _prefill("fc2", bucket=64, layout=ch.layout_word(8, 8, "nccl", "bfloat16"))
    assert wide.expected_s(other) == 0.0  # nothing measured on that layout: the first measurement runs
    # samples that count a shared part more than once (the query-split pair adds the attention, timed once a
    # round, to each GEMM + RS): the seconds that ran are charged, not the samples' sum
    shared = ch.chooser_of(config.from_dict({**AUTO, "choices": {"budget_s": 4.0}}, config.Environment()))
    shared.decide(_prefill(), ch.Measured({"reference": [0.5] * 2, "decomposed": [0.5] * 2}, 1.5))
    assert shared.spent_s == pytest.approx(1.5) and shared.costs[next(iter(shared.costs))][1] == pytest.approx(1.5)


def test_a_row_sites_prefill_and_mixed_keys_share_one_measurement_unless_pinned():
    c = ch.chooser_of(config.from_dict({**AUTO}, config.Environment()))
    c.decide(_prefill(), ch.Measured.of({"reference": [2.0] * 5, "decomposed": [1.0] * 5}))
    assert c.answer(_prefill(kind="mixed")).pick == "decomposed" and c.spent_s == pytest.approx(15.0)
    assert c.answer(_prefill("fc2", "mixed")) is None  # another site is measured on its own
    pinned = ch.chooser_of(config.from_dict({**AUTO, "choices": {"pinned": {"proj/mixed/16": "reference"}}},
                                            config.Environment()))
    pinned.decide(_prefill(), ch.Measured.of({"reference": [2.0] * 5, "decomposed": [1.0] * 5}))
    assert pinned.answer(_prefill(kind="mixed")).source == "pinned"
    decode = ch.chooser_of(config.from_dict({**AUTO}, config.Environment()))
    decode.decide(_decode(), ch.Measured.of({"reference": [2.0] * 5, "ring": [1.0] * 5}))
    assert list(decode.decided) == [_decode()]  # a decode key has no twin


def test_the_written_file_passed_back_reproduces_every_choice(tmp_path):
    import yaml

    env = config.Environment()
    cfg = config.from_dict({**AUTO, "proj": {"algo": "slicing", "num_chunks": 2}}, env)
    c = ch.chooser_of(cfg)
    keys = [_prefill(), _prefill("fc2", "mixed", 8), _decode(2)]
    picks = [c.decide(keys[0], ch.Measured.of({"reference": [2.0] * 5, "decomposed": [1.0] * 5})).pick,
             c.decide(keys[1], ch.Measured.of({"reference": [1.0] * 5, "decomposed": [2.0] * 5})).pick,
             c.fallback(keys[2], "budget").pick]
    path = tmp_path / "choices.yaml"
    path.write_text(yaml.safe_dump(c.as_config()))
    again = config.load_config(path, env)
    assert again.proj == cfg.proj  # the rest of the config travels too
    back = ch.chooser_of(again)
    assert [back.answer(k).pick for k in keys] == picks == ["decomposed", "reference", "reference"]
    assert all(back.answer(k).source == "pinned" for k in keys)


def test_one_chooser_per_config_object():
    cfg = config.from_dict({}, config.Environment())
    assert ch.chooser_of(cfg) is ch.chooser_of(cfg)
    assert ch.chooser_of(config.from_dict({}, config.Environment())) is not ch.chooser_of(cfg)


@pytest.mark.parametrize("bad", [{"proj/decode/4": "ring"}, {"all_reduce/decode/4": "decomposed"},
                                 {"qkv/prefill/4": "reference"}, {"proj/prefill/x": "reference"},
                                 {"moe/train/64": "flash_c2"}, {"ulysses/train/64": "flash_c2"}])
def test_config_refuses_a_pinned_word_the_chooser_never_writes(bad):
    with pytest.raises(ValueError, match="choices.pinned"):
        config.from_dict({"choices": {"pinned": bad}}, config.Environment())


def test_a_tp_layers_training_pick_may_be_flash_with_hop_sub_chunks():
    """flash_c2 is a TP layer's candidate (megatron/train_choice.py), not the MoE exchange's or Ulysses'."""
    cfg = config.from_dict({"choices": {"pinned": {"qkv/train/512": "flash_c2", "fc2/train/1024": "flash"}}},
                           config.Environment())
    assert dict(cfg.choices.pinned) == {"qkv/train/512": "flash_c2", "fc2/train/1024": "flash"}


def test_the_line_names_the_key_the_pick_and_the_medians():
    c = ch.chooser_of(config.from_dict({}, config.Environment()))
    got = c.decide(_prefill(), ch.Measured.of({"reference": [2e-3] * 5, "decomposed": [1e-3] * 5}))
    text = ch.line(_prefill(), got)
    assert "decomposed for proj/prefill/16" in text and "reference 2000 us" in text and "decomposed 1000 us" in text


def test_writer_replaces_only_the_same_key(tmp_path):
    path = str(tmp_path / "cal.json")
    write(path, _entry(dtype="float32"))
    write(path, _entry(dtype="bfloat16"))
    write(path, _entry(backend="nccl"))
    write(path, _entry(dtype="float32", rows=ROWS[:1]))  # a re-run replaces its own entry only
    got = json.load(open(path))["tables"]
    keys = sorted((t["backend"], t["dtype"], len(t["rows"])) for t in got)
    assert keys == [("gloo", "bfloat16", 2), ("gloo", "float32", 1), ("nccl", "float32", 2)]
