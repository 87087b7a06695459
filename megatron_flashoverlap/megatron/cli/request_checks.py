"""Request checks of the server entry (serve.py), before a request reaches Megatron's engine, which does not
check: a value out of range there either drops the engine (top_p 2.0, logprobs past the vocabulary) or answers
nonsense (negative temperature, ids outside the vocabulary).

    check(path, body, limits) -> None | "field: why (range)"     the 400 of one request body
    Limits(vocab, positions)                                      the model's: token ids in [0, vocab), a prompt
                                                                  plus its max_tokens within `positions`
    install(limits)                                               every frontend (Megatron's Quart app, forked from
                                                                  rank 0 after this) runs `check` first

    field          range checked                    endpoints
    prompt         token ids in [0, vocab)          /completions, /v1/completions (strings: the tokenizer's)
    temperature    >= 0                             both completions and chat completions
    top_p          0 < top_p <= 1                   both (temperature 0 is greedy: Megatron then ignores top_p)
    top_k          integer >= 0                     both
    max_tokens     integer >= 1, prompt + it <= positions   both (max_completion_tokens too on chat)
    logprobs       integer in [0, vocab] (completions: top-n over the vocabulary); chat: a bool, top_logprobs
                   in [0, vocab]
"""
from __future__ import annotations

from dataclasses import dataclass

COMPLETIONS = ("/completions", "/v1/completions")
CHAT = ("/chat/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class Limits:
    vocab: int
    positions: int


def _number(body, key, integer=False):
    """(value or None, error or None): a present `key` must be a number (an integer where `integer`)."""
    if key not in body or body[key] is None:
        return None, None
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        return None, f"{key}: {v!r} is not {'an integer' if integer else 'a number'}"
    return v, None


def _sampling(body, limits: Limits, longest: int) -> str | None:
    checks = (("temperature", False, lambda v: v >= 0, ">= 0"),
              ("top_p", False, lambda v: 0 < v <= 1, "0 < top_p <= 1"),
              ("top_k", True, lambda v: v >= 0, "an integer >= 0"))
    for key, integer, ok, rule in checks:
        v, err = _number(body, key, integer)
        if err or (v is not None and not ok(v)):
            return err or f"{key}: {v!r} is out of range ({rule})"
    for key in ("max_tokens", "max_completion_tokens"):
        v, err = _number(body, key, True)
        room = limits.positions - longest
        if err or (v is not None and not 1 <= v <= room):
            return err or (f"{key}: {v} is out of range (1 <= {key} <= {room}: the model's {limits.positions} "
                           f"positions less the longest prompt's {longest} tokens)")
    return None


def _prompt_ids(prompt) -> list:
    """The token-id prompts of a completions body ([] where the prompt is text or malformed: Megatron answers)."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [p for p in prompt if all(isinstance(t, int) and not isinstance(t, bool) for t in p)]
    return []


def check(path: str, body, limits: Limits) -> str | None:
    """Why `body` of a request to `path` gets a 400 (None: pass it on)."""
    if not isinstance(body, dict):
        return None  # Megatron's own 400 ("Invalid or missing JSON body")
    if path in COMPLETIONS:
        prompts = _prompt_ids(body.get("prompt"))
        for i, p in enumerate(prompts):
            bad = next((t for t in p if not 0 <= t < limits.vocab), None)
            if bad is not None:
                return f"prompt: token id {bad} (prompt {i}) is out of range (0 <= id < {limits.vocab}, the vocabulary)"
        v, err = _number(body, "logprobs", True)
        if err or (v is not None and not 0 <= v <= limits.vocab):
            return err or f"logprobs: {v} is out of range (0 <= logprobs <= {limits.vocab}, the vocabulary)"
        return _sampling(body, limits, max((len(p) for p in prompts), default=0))
    if path in CHAT:
        v, err = _number(body, "top_logprobs", True)
        if err or (v is not None and not 0 <= v <= limits.vocab):
            return err or f"top_logprobs: {v} is out of range (0 <= top_logprobs <= {limits.vocab}, the vocabulary)"
        return _sampling(body, limits, 0)
    return None


def install(limits: Limits) -> None:
    """Megatron's frontend app runs `check` before its endpoints: a blueprint of ours first in its endpoint list,
    whose app-wide before-request hook answers a 400 {"error": {"message", "type", "param"}} (OpenAI's shape)."""
    from megatron.core.inference.text_generation_server.dynamic_text_gen_server import endpoints
    from quart import Blueprint, jsonify, request

    if any(getattr(bp, "name", "") == "flashoverlap_checks" for bp in endpoints.__all__):
        return
    bp = Blueprint("flashoverlap_checks", __name__)

    @bp.before_app_request
    async def _checked():
        if request.method != "POST" or request.path not in (*COMPLETIONS, *CHAT):
            return None
        why = check(request.path, await request.get_json(force=True, silent=True), limits)
        if why is None:
            return None
        return jsonify({"error": {"message": why, "type": "invalid_request_error",
                                  "param": why.split(":", 1)[0]}}), 400

    endpoints.__all__.insert(0, bp)
