"""Tier 3 (Megatron on 2 gloo ranks; newest lane: MegatronLLM is megatron-core 0.17+): batch-invariant decoding through Megatron's own inference stack.

A request's tokens and log-probs do not depend on what else is in the batch, with our layers as with stock:
Megatron-LM's test_text_generation_controller.py::test_zero_tokens_generated_batch_vs_single rebuilt on the
wheel's API (same model: 4 layers, hidden 32, bf16, attention_backend local, TP = 2; our spec called through
Megatron's local-spec signature), plus decoding 8 tokens, through the text-generation controller (static
batching) and through the dynamic engine behind MegatronLLM (on CPU its paged attention is
megatron/cpu_flash_attn.py). Four prompts of lengths 15, 42, 57 and 9 (three of them odd: the prefill GEMMs
see token counts that TP = 2 does not divide). Bodies in tests/megatron/mp_inference.py; one job, one model
build per spec.

Tolerances: batch vs alone -- Megatron's own test's (pytest.approx, 1e-6 relative: another batch shape may
pick another GEMM kernel); ours vs stock -- exact (same core attention, same weights, and each all-reduce
sums two partials: a + b == b + a); dynamic engine vs static batching -- the greedy tokens only (their
attention kernels differ: the paged CPU one computes in fp32, so log-probs are close, not equal).
"""
import pytest

JOB = "tests.megatron.mp_inference:batch_invariance"
GENERATE = 8
PROMPTS = (15, 42, 57, 9)  # mp_inference.PROMPT_LENGTHS


@pytest.fixture(scope="module")
def results(pools):
    return pools(2).run(JOB, 2, GENERATE, timeout=600)


def _same_alone_and_batched(runs: dict, key: str) -> None:
    for alone_key in [k for k in ("single", "reversed") if k in runs]:
        for rid, batched in runs["batch"].items():
            alone = runs[alone_key][rid]
            assert batched["tokens"] == alone["tokens"], (key, alone_key, rid)
            for field in ("prompt_log_probs", "generated_log_probs"):
                if batched[field] is None:
                    assert alone[field] is None
                    continue
                assert batched[field] == pytest.approx(alone[field]), (key, alone_key, rid, field)


@pytest.mark.newest_only  # MegatronLLM (megatron.core.inference.apis) is new in megatron-core 0.17+
@pytest.mark.parametrize("path", ["static0", "static", "dynamic"])
@pytest.mark.parametrize("spec", ["stock", "flash"])
def test_a_request_decodes_the_same_alone_and_in_a_batch(results, path, spec):
    for rank in results:
        _same_alone_and_batched(rank[path][spec], f"{path}/{spec}")
    runs = results[0][path][spec]
    assert all(len(r["prompt_log_probs"]) == n - 1 for r, n in zip(runs["batch"].values(), (15, 42, 57, 9)))
    if path == "static0":  # Megatron's case: no token generated, the prompt's top-5 log-probs per position
        for rid, batched in runs["batch"].items():
            assert batched["tokens"] in ([], None) and batched["top_n"], rid
            assert batched["top_n"] == runs["single"][rid]["top_n"] or all(
                a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()))
                for a, b in zip(batched["top_n"], runs["single"][rid]["top_n"]))
    else:
        assert all(len(r["tokens"]) >= 1 for r in runs["batch"].values())


@pytest.mark.newest_only
@pytest.mark.parametrize("path", ["static0", "static", "dynamic"])
def test_our_layers_decode_exactly_as_stock(results, path):
    for rank in results:
        assert rank[path]["flash"] == rank[path]["stock"], path


@pytest.mark.newest_only
def test_dynamic_engine_greedy_tokens_match_static_batching(results):
    static, dynamic = results[0]["static"]["stock"]["batch"], results[0]["dynamic"]["stock"]["batch"]
    for rid in static:
        s, d = static[rid]["tokens"], dynamic[rid]["tokens"]
        assert len(d) == GENERATE and s == d[:len(s)] and len(s) >= 1, (rid, s, d)  # static stops at eod


@pytest.mark.parametrize("backend, expected", [("local", "DotProductAttention"), ("auto", "DotProductAttention"),
                                               ("flash", "SdpaDotProductAttention")])
def test_spec_function_carries_the_attention_backend(backend, expected):
    """get_gpt_layer_flashoverlap_spec takes the model config's attention backend (Megatron's inference tests
    set AttnBackend.local on the config) and builds the core attention layer_spec builds for it (the table in
    tests/megatron/test_core_attention.py: local / auto -> Megatron's DotProductAttention, flash -> SDPA)."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_flashoverlap.megatron.spec import get_gpt_layer_flashoverlap_spec, submodules_of

    spec = get_gpt_layer_flashoverlap_spec(attention_backend=AttnBackend[backend], context_parallel_size=1)
    core = submodules_of(spec.submodules.self_attention).core_attention
    assert getattr(core, "module", core).__name__ == expected


@pytest.mark.newest_only
def test_dynamic_engine_decode_steps_take_the_decode_all_reduce(results):
    """The dynamic engine lays tokens out flat, [n, 1, h] (n: the step's tokens, padded up by the engine): a
    decode-only step of the four requests is not [1, b, h], yet each of its row-parallel calls (proj and fc2 of
    4 layers: 8 per step) runs the GEMM then one all-reduce of its n >= 4 new tokens (all_reduce sees
    [1, n, h = 32]) by the algorithm the chooser decided for its bucket; the prefill step runs all >= 123
    prompt tokens at once through the row operator with the plan the chooser decided for proj and fc2 at
    that bucket (stock: the reference plan; decomposed: the layer's flash). The requests decode together: one
    prefill step, then GENERATE - 1 decode-only steps."""
    for rank in results:
        calls, decided = rank["routes"], rank["decided"]
        decode = [(op, shape, algo) for step, op, shape, algo in calls if step == "decode"]
        prefill = [(op, shape, algo) for step, op, shape, algo in calls if step == "prefill"]
        assert len(decode) == 8 * (GENERATE - 1) and len(prefill) == 8, calls
        assert all(op == "decode" and shape[0] == 1 and shape[1] >= len(PROMPTS) and shape[2] == 32
                   and algo == decided[f"all_reduce/decode/{1 << (shape[1] - 1).bit_length()}"]
                   for op, shape, algo in decode), (decode, decided)
        assert all(op == "decomposed" and shape[0] >= sum(PROMPTS) and shape[1] == 1 for op, shape, _ in prefill)
        want = {site: "flash" if decided[f"{site}/prefill/{1 << (prefill[0][1][0] - 1).bit_length()}"] ==
                "decomposed" else "reference" for site in ("proj", "fc2")}
        assert [algo for _, _, algo in prefill] == [want["proj"], want["fc2"]] * 4, (prefill, decided)


@pytest.mark.newest_only
def test_dynamic_engine_first_step_decides_every_bucket_it_can_meet(results):
    """Megatron pads a dynamic step's tokens to a multiple of round_up_tokens(1), at most max_tokens, a decode
    step to at most min(max_tokens, max_requests) (dynamic_context.py): the chooser's key of every token count
    the engine can meet is decided before the first row-parallel call runs (megatron/step_kind.py), so no later
    request waits on a measurement: the number of decided keys never changes from call to call, and none of
    the later generations (each prompt alone, the reversed batch) measured anything."""
    def next_pow2(n):
        return 1 << (n - 1).bit_length()

    for rank in results:
        max_tokens, max_requests, step = rank["context"]
        tokens = range(step, max_tokens + 1, step)
        words = {f"{site}/{kind}/{next_pow2(t)}" for t in tokens for site in ("proj", "fc2")
                 for kind in ("prefill", "mixed")}
        words |= {f"all_reduce/decode/{next_pow2(min(t, max_tokens, max_requests))}" for t in tokens}
        assert words <= rank["decided"].keys(), sorted(words - rank["decided"].keys())
        assert len(set(rank["decided_at_calls"])) == 1, rank["decided_at_calls"]
        assert rank["measured_later_s"] == 0.0
        assert {rank["sources"][w] for w in words} <= {"measured", "model", "yaml"}
