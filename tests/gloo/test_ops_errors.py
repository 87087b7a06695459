"""Tier 2 (2 gloo processes): every bad input gets a clear ValueError naming the fix; no hang."""
import pytest

from tests.support import Pool

EXPECT = {  # case -> words the message must contain (what is wrong and what to change)
    "rs_indivisible": ["not divisible", "pad the sequence"],
    "dtype": ["dtype", "cast"],
    "device": ["device", "move"],
    "weight_shape": ["weight must be", "[out, in]"],
    "transposed_weight": ["weight must be", "not transposed"],
    "not_3d": ["[s, b, h]", "Reshape"],
    "int_dtype": ["not supported", "float32"],
    "bias_shape": ["bias must be"],
    "unknown_algo": ["unknown algo", "flash"],
    "slicing_no_chunks": ["num_chunks"],
}


def test_bad_inputs_name_the_fix(pools):
    for rank_out in pools(2).run("tests.gloo.mp_ops:bad_inputs"):
        for case, words in EXPECT.items():
            msg = rank_out[case]
            assert msg is not None, f"{case}: no error raised"
            for w in words:
                assert w in msg, f"{case}: {w!r} not in {msg!r}"


def test_disagreeing_ranks_raise_on_every_rank(pools):
    for msg in pools(2).run("tests.gloo.mp_ops:disagreeing_ranks"):
        assert msg is not None and "disagree" in msg and "same sequence length" in msg


def test_group_of_one_is_plain_gemm(pools):
    assert all(pools(2).run("tests.gloo.mp_ops:group_of_one"))


def test_dead_peer_times_out_with_clear_error():
    pool = Pool(2)  # its own pool: a timed-out transfer leaves the process group unusable
    try:
        out = pool.run("tests.gloo.mp_ops:dead_peer", 2.0, timeout=60)[0]
    finally:
        pool.close()
    assert out["message"] is not None, "no PeerTimeoutError raised"
    assert "did not complete" in out["message"] and "restart" in out["message"]
    assert out["seconds"] < 30
