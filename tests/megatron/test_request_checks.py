"""The server entry's request checks (megatron/cli/request_checks.py): each out-of-range field gets its reason,
in-range bodies pass (the HTTP side, a 400 from the running server, is in tests/megatron/test_serve.py)."""
import pytest

from megatron_flashoverlap.megatron.cli.request_checks import Limits, check

LIMITS = Limits(vocab=128, positions=64)
OK = {"prompt": [[1, 5, 9], [4] * 11], "max_tokens": 6, "temperature": 0, "logprobs": 1, "ignore_eos": True}


@pytest.mark.parametrize("change, words", [
    ({"top_p": 2.0}, ["top_p", "0 < top_p <= 1"]),
    ({"top_p": 0}, ["top_p"]),
    ({"logprobs": 1000}, ["logprobs", "0 <= logprobs <= 128"]),
    ({"temperature": -1}, ["temperature", ">= 0"]),
    ({"top_k": -5}, ["top_k", ">= 0"]),
    ({"top_k": 1.5}, ["top_k", "not an integer"]),
    ({"max_tokens": 0}, ["max_tokens", "1 <= max_tokens <= 53"]),  # 64 positions less the 11-token prompt
    ({"max_tokens": 54}, ["max_tokens", "<= 53"]),
    ({"prompt": [[1, 128]]}, ["prompt", "token id 128", "0 <= id < 128"]),
    ({"prompt": [3, -1]}, ["prompt", "token id -1"]),
    ({"temperature": "hot"}, ["temperature", "not a number"]),
    ({"logprobs": True}, ["logprobs", "not an integer"]),
])
def test_each_out_of_range_field_is_named_with_its_range(change, words):
    why = check("/v1/completions", {**OK, **change}, LIMITS)
    assert why is not None and why.startswith(words[0] + ":"), why
    for w in words[1:]:
        assert w in why, (w, why)


def test_in_range_bodies_pass():
    assert check("/v1/completions", OK, LIMITS) is None
    assert check("/completions", {**OK, "max_tokens": 53, "top_p": 1.0, "top_k": 0, "logprobs": 128}, LIMITS) is None
    assert check("/v1/completions", {"prompt": "text is the tokenizer's", "max_tokens": 4}, LIMITS) is None
    assert check("/v1/chat/completions", {"messages": [], "temperature": 0.7, "top_logprobs": 5}, LIMITS) is None
    assert check("/health", {"top_p": 9}, LIMITS) is None  # other endpoints are not ours to check


def test_chat_completions_share_the_sampling_checks():
    assert check("/v1/chat/completions", {"messages": [], "top_p": 2.0}, LIMITS).startswith("top_p:")
    assert check("/chat/completions", {"messages": [], "max_completion_tokens": 0}, LIMITS).startswith(
        "max_completion_tokens:")
    assert check("/v1/chat/completions", {"messages": [], "top_logprobs": 1000}, LIMITS).startswith("top_logprobs:")
