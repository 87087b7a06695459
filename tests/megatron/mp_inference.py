"""Worker bodies for test_inference_batch.py: Megatron's own inference stack (GPTInferenceWrapper,
TextGenerationController, the dynamic engine) over a tiny bf16 GPT, stock layers or ours, on 2 gloo ranks.

The model is the one Megatron-LM's test_text_generation_controller.py builds (4 layers, hidden 32, 4 heads,
vocab 100, bias, attention_backend local, bf16 in Float16Module, TP = 2); stock is `get_gpt_layer_local_spec()`,
ours is `get_gpt_layer_flashoverlap_spec()` called as that test calls the local one (Megatron's own signature),
with the same weights (copied). Every body destroys the model-parallel state in a `finally`."""
from __future__ import annotations

import copy
import time
from collections import OrderedDict

import torch

from megatron_flashoverlap.megatron import models as tm

VOCAB, SEQ = 100, 64
# prompt lengths of Megatron's test (len(prompt) + 1 for its three prompts) and one more that is odd
PROMPT_LENGTHS = (15, 42, 57, 9)


def _config(tp: int):
    """Megatron's test config (test_text_generation_controller.setup_model, bf16)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                             attention_backend=AttnBackend.local, params_dtype=torch.bfloat16,
                             pipeline_dtype=torch.bfloat16, tensor_model_parallel_size=tp, bf16=True,
                             add_bias_linear=True, gradient_accumulation_fusion=False)


def _models(tp: int) -> dict:
    """{"stock": Float16Module(GPTModel(local spec)), "flash": the same with our spec, same weights}, eval."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from megatron_flashoverlap.megatron.spec import get_gpt_layer_flashoverlap_spec

    cfg, built = _config(tp), {}
    for name, spec in (("stock", get_gpt_layer_local_spec()), ("flash", get_gpt_layer_flashoverlap_spec())):
        torch.manual_seed(7)
        model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         parallel_output=True)
        built[name] = Float16Module(cfg, model).eval()
    tm.copy_weights(built["flash"], built["stock"])
    return built


def _tokenizer():
    """Megatron's NullTokenizer (token ids written as text), as `--tokenizer-type NullTokenizer` builds it."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=VOCAB)


def _prompts() -> list[list[int]]:
    """Random prompts (same on every rank), bos 0 first, no eod (VOCAB - 1) inside."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, VOCAB - 2, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    for p in prompts:
        p[0] = 0
    return prompts


def _sampling(generate: int):
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(num_tokens_to_generate=generate, temperature=0.0, top_k=1, return_log_probs=True,
                          top_n_logprobs=5 if generate == 0 else 0, skip_prompt_log_probs=False,
                          termination_id=-1)  # no early stop: every request decodes `generate` tokens


def _floats(x) -> list | None:
    return None if x is None else [float(v) for v in (x.tolist() if torch.is_tensor(x) else x)]


def _record(req) -> dict:
    tokens = req.generated_tokens
    return {"tokens": None if tokens is None else [int(t) for t in (tokens.tolist() if torch.is_tensor(tokens)
                                                                   else tokens)],
            "prompt_log_probs": _floats(req.prompt_log_probs),
            "generated_log_probs": _floats(req.generated_log_probs),
            "top_n": req.prompt_top_n_logprobs}


def _static_controller(model):
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController)

    context = StaticInferenceContext(max_batch_size=len(PROMPT_LENGTHS), max_sequence_length=128)
    wrapped = GPTInferenceWrapper(model, context)
    wrapped.model_is_pipeline_parallel = False
    return TextGenerationController(inference_wrapped_model=wrapped, tokenizer=_tokenizer())


def _static_run(controller, prompts, generate: int, ids) -> dict:
    """generate_all_output_tokens_static_batch over the requests `ids` together -> {id: record}."""
    from megatron.core.inference.inference_request import InferenceRequest, Status

    requests = OrderedDict((str(i), InferenceRequest(
        request_id=str(i), prompt=" ".join(map(str, prompts[i])), prompt_tokens=list(prompts[i]),
        sampling_params=copy.deepcopy(_sampling(generate)), arrival_time=time.time(),
        status=Status.ACTIVE_BUT_NOT_GENERATING_TOKENS)) for i in ids)
    done = controller.generate_all_output_tokens_static_batch(requests)
    return {int(k): _record(r) for k, r in done.items()}


def static_batch_vs_single(rank, world, tp=2, generate=0):
    """Megatron's text-generation controller (static batching), each model: every prompt in one batch, then
    each alone -> {model: {"batch": {id: record}, "single": {id: record}}}."""
    from megatron.core.inference.utils import InferenceMode

    tm.init_tp(tp)
    try:
        prompts, out = _prompts(), {}
        for name, model in _models(tp).items():
            controller = _static_controller(model)
            InferenceMode.set_active()
            ids = range(len(prompts))
            single = {}
            for i in ids:
                single.update(_static_run(controller, prompts, generate, [i]))
            out[name] = {"batch": _static_run(controller, prompts, generate, ids), "single": single}
        return out
    finally:
        InferenceMode.unset_active()  # process-wide: a later job in this worker trains (the test pool)
        tm.destroy()


def _llm(model, max_requests: int = 8):
    """Megatron's high-level API in direct mode (every rank drives the engine with the same prompts)."""
    from megatron.core.inference.apis import MegatronLLM
    from megatron.core.inference.config import InferenceConfig

    config = InferenceConfig(max_sequence_length=128, buffer_size_gb=0.01, block_size_tokens=16,
                             max_requests=max_requests, max_tokens=512, unified_memory_level=0,
                             materialize_only_last_token_logits=False)
    return MegatronLLM(model=model, tokenizer=_tokenizer(), inference_config=config, use_coordinator=False)


def _dynamic_record(req) -> dict:
    return {"tokens": [int(t) for t in req.generated_tokens],
            "prompt_log_probs": _floats(req.prompt_log_probs),
            "generated_log_probs": _floats(req.generated_log_probs)}


class _Routes:
    """Counts, per step kind of the dynamic engine, the row-parallel calls that ran the decode all-reduce
    (`all_reduce` as matmul_all_reduce calls it) and the decomposed one (`ar_matmul_forward`): the operator's
    own functions, wrapped for the block. The step kind is the engine's: its context's prefill request count."""

    def __init__(self, llm, model):
        from megatron_flashoverlap.ops.tp_nosp import autograd as arm

        self.arm, self.context, self.calls, self.decided = arm, llm.engine.context, [], []
        row = next((m for m in model.modules() if hasattr(m, "flash_chooser")), None)
        self.chooser = None if row is None else row.flash_chooser  # how many keys it had decided at each call
        self.real = {"decode": arm.all_reduce, "decomposed": arm.ar_matmul_forward}

    def _counting(self, kind):
        real = self.real[kind]

        def call(x, *args, **kwargs):
            step = "prefill" if self.context.num_prefill_requests else "decode"
            algo = args[3].algo if kind == "decomposed" else kwargs.get("algo")  # the plan / the all-reduce's algo
            self.calls.append((step, kind, tuple(x.shape), algo))
            self.decided.append(len(self.chooser.decided) if self.chooser is not None else None)
            return real(x, *args, **kwargs)
        return call

    def __enter__(self):
        self.arm.all_reduce, self.arm.ar_matmul_forward = self._counting("decode"), self._counting("decomposed")
        return self

    def __exit__(self, *exc):
        self.arm.all_reduce, self.arm.ar_matmul_forward = self.real["decode"], self.real["decomposed"]


def dynamic_batch_vs_single(rank, world, tp=2, generate=8):
    """Megatron's dynamic engine through MegatronLLM.generate, each model: every prompt together, then each
    alone, then in reverse order -> {model: {"batch" | "single" | "reversed": {id: record}}, "routes": the batch
    run's row-parallel calls of our model, [(step kind, operator, x's shape)] (_Routes)}."""
    tm.init_tp(tp)
    try:
        prompts, out = _prompts(), {}
        sampling = _sampling(generate)
        sampling.top_n_logprobs = 0
        for name, model in _models(tp).items():
            with _llm(model) as llm:
                with _Routes(llm, model) as routes:
                    batch = llm.generate(prompts, sampling)
                if name == "flash":
                    out["routes"], out["decided_at_calls"] = routes.calls, routes.decided
                    row = next(m for m in model.modules() if hasattr(m, "flash_chooser"))
                    out["decided"] = {k.word: c.pick for k, c in row.flash_chooser.decided.items()}
                    out["sources"] = {k.word: c.source for k, c in row.flash_chooser.decided.items()}
                    context = llm.engine.context
                    out["context"] = (context.max_tokens, context.max_requests, context.round_up_tokens(1))
                    spent = row.flash_chooser.spent_s
                llm.engine.reset()
                single = {}
                for i, p in enumerate(prompts):
                    single[i] = _dynamic_record(llm.generate([p], sampling)[0])
                    llm.engine.reset()
                backwards = llm.generate(prompts[::-1], sampling)[::-1]
                if name == "flash":
                    out["measured_later_s"] = row.flash_chooser.spent_s - spent
            out[name] = {"batch": {i: _dynamic_record(r) for i, r in enumerate(batch)}, "single": single,
                         "reversed": {i: _dynamic_record(r) for i, r in enumerate(backwards)}}
        return out
    finally:  # the engine's process-wide InferenceMode: the pool ends it with the job (tests/support/pool.py)
        tm.destroy()


def batch_invariance(rank, world, tp=2, generate=8):
    """Both paths in one job (one model build): {"static0": Megatron's zero-token case (prompt log-probs, top-n),
    "static": static batching generating `generate` tokens, "dynamic": the dynamic engine}."""
    out = {"static0": static_batch_vs_single(rank, world, tp, 0),
           "static": static_batch_vs_single(rank, world, tp, generate),
           "dynamic": dynamic_batch_vs_single(rank, world, tp, generate)}
    out["routes"] = out["dynamic"].pop("routes")
    for field in ("decided", "sources", "context", "measured_later_s", "decided_at_calls"):
        out[field] = out["dynamic"].pop(field)
    return out
