"""Every Megatron flag, or combination of flags, that the `--flash-overlap` layers cannot honour: one row each,
read by every check that refuses it. Adding a flag is adding a row; no check holds a message of its own.

    Refusal(flag, field, op, value, reason, fix, at, args=None, also=())   one row (below)
    ROWS                                   the table, in the order each check tries it
    rows(at) -> (Refusal, ...)             the rows the check `at` reads
    found(at, source, **facts) -> (row, value) | None    the first row of `at` whose condition holds: a field is
                                           read as facts[field], else getattr(source, field, None) (None: unset)
    said(row, value) -> str                "<the flag as typed> <reason>"
    unhonoured(at, source, **facts) -> str | None
                                           said(...) of the first row that holds: a fallback's logged reason
    refuse(at, source, where, **facts)     ValueError "<where>: <the flag as typed> <reason>; <fix>" for the
                                           first row that holds
    markdown() -> str                      the table as docs/megatron.md shows it (python -m ...config.refusals)

A condition is data: the row's field, an op and a value, and `also` tests (field, op, value), all of which must
hold. Ops: on (set), off (not set), ==, !=, not in, > (a set value against `value`), has (a set collection holds
`value`). Unset is None or a false plain value (False, 0, "", an empty list): a flag the user did not give is
never refused, except where its absence is the refusal (off). An enum compares by its name, a list (argparse's
nargs) as a tuple.

Which check reads a row (`at`), and what it reads:
    parse         megatron/cli/args.py: Megatron-LM's parsed args (a row's `args` name where it differs), before
                  validate_args
    spec          the model config, where our block spec is built (megatron/spec.py: flashoverlap_layer_spec and
                  the layers of the ModuleSpec flashoverlap_layer), also for users who build their own model
    local_spec    megatron/spec.py get_gpt_layer_flashoverlap_spec: its arguments, those of Megatron's
                  get_gpt_layer_local_spec
    linear        megatron/linear.py: our linears' model config (a model built from layer_spec alone)
    moe           megatron/moe/layer.py check_moe_config
    norm          megatron/norm.py check_norm_config
    ulysses, query_split, sdpa    our core attentions: megatron/attention.py, megatron/query_split_pair.py
                  (under attention.query_split auto its rows refuse nothing: they keep query split out of
                  proj's candidates), megatron/sdpa.py
    stock_attention   not refused: the SDPA and query-split attentions build Megatron's DotProductAttention
                  instead (logged once, megatron/sdpa.py megatron_instead); Ulysses (CP > 1) refuses them
    dp            megatron/ddp/pretrain.py: refused under dp: {fuse: all}; otherwise the reason a DDP chunk (or,
                  megatron/ddp/grad_sync.py, a weight) stays on Megatron's reduce-scatter, logged
    entry         megatron/cli/pretrain_gpt.py: the project's own pretrain entry
Not here: what is honoured by running stock's code, logged once where it is met (TP 1, algo reference,
gather_output, --moe-shared-expert-overlap: megatron/linear.py _stock_reason; the allgather dispatcher;
--persist-layer-norm; several distributed-optimizer instances: megatron/ddp/grad_sync.py), checks of our own
YAML, and what a forward call is given (attention bias, packed sequences).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

FLAG = "--flash-overlap"
# the --spec values that are ours: megatron/cli/args.py selects the first; the second is the block-spec function
OUR_SPECS = (("megatron_flashoverlap.spec", "flashoverlap_layer"),
             ("megatron_flashoverlap.spec", "flashoverlap_layer_spec"))

# check word -> when it runs (markdown's last column)
CHECKS = {
    "parse": "parse", "spec": "model build", "local_spec": "get_gpt_layer_flashoverlap_spec",
    "linear": "linear build", "moe": "MoE layer build", "norm": "norm build", "ulysses": "Ulysses attention build",
    "query_split": "query-split attention build", "sdpa": "SDPA attention build",
    "stock_attention": "SDPA / query-split build: Megatron's DotProductAttention instead, logged",
    "dp": "parse and DDP build under dp: {fuse: all}; else stock DDP, logged",
    "entry": "megatron_flashoverlap.pretrain_gpt",
}
_OPS = {"on": lambda v, x: True, "==": lambda v, x: v == x, "!=": lambda v, x: v != x,
        "not in": lambda v, x: v not in x, ">": lambda v, x: v > x, "has": lambda v, x: x in v}
OPS = ("off", *_OPS)


@dataclass(frozen=True)
class Refusal:
    """One flag our layers cannot honour. `flag`: as the user types it (a model-config field where no flag sets
    it); `field`: the attribute the checks read (on Megatron's model config, DDP config, or parsed args);
    `args`: the parsed-args name where a row read at parse differs; `reason` follows the flag as typed in the
    message, `fix` says what to change."""

    flag: str
    field: str
    op: str
    value: object
    reason: str
    fix: str
    at: tuple[str, ...]
    args: str | None = None
    also: tuple[tuple[str, str, object], ...] = ()

    def name(self, at: str) -> str:
        return self.args if at == "parse" and self.args else self.field


def _unset(value) -> bool:
    """None, or a false plain value (False, 0, "", an empty list): what Megatron leaves a flag not given as."""
    return value is None or (isinstance(value, (bool, int, float, str, list, tuple)) and not value)


def _typed(value):
    """A value as compared and shown: an enum by its name, a list (argparse's nargs) as a tuple."""
    return value.name if isinstance(value, enum.Enum) else tuple(value) if isinstance(value, list) else value


def holds(value, op: str, x) -> bool:
    if op == "off":
        return _unset(value)
    return not _unset(value) and _OPS[op](_typed(value), x)


def _read(source, facts, field):
    return facts[field] if field in facts else getattr(source, field, None)


def rows(at: str) -> tuple[Refusal, ...]:
    if at not in CHECKS:  # a misspelt check would read no row and refuse nothing
        raise KeyError(f"no check {at!r}: one of {tuple(CHECKS)}")
    return tuple(r for r in ROWS if at in r.at)


def found(at: str, source=None, **facts):
    """(row, value) of the first row of check `at` whose condition holds; None if none does."""
    for row in rows(at):
        value = _read(source, facts, row.name(at))
        if holds(value, row.op, row.value) and all(holds(_read(source, facts, f), o, x) for f, o, x in row.also):
            return row, value
    return None


def _as_typed(value) -> str:
    """A flag's value as typed: a list (argparse's nargs) space-separated, a tuple (Megatron's tuple_type)
    comma-separated, an enum by its name."""
    if isinstance(value, (list, tuple)):
        return (" " if isinstance(value, list) else ",").join(map(str, value))
    return str(_typed(value))


def said(row: Refusal, value) -> str:
    """The flag as the user typed it (a config field as field=value), then the row's reason."""
    if row.op == "off":
        shown = f"without {row.flag},"
    elif value is True:
        shown = row.flag
    elif not row.flag.startswith("--"):
        shown = f"{row.flag}={_typed(value)!r}"
    else:
        shown = f"{row.flag} {_as_typed(value)}"
    return f"{shown} {row.reason}"


def unhonoured(at: str, source=None, **facts) -> str | None:
    """The flag as typed and the reason of the first row of check `at` that holds, for a fallback's log line."""
    hit = found(at, source, **facts)
    return None if hit is None else said(*hit)


def refuse(at: str, source, where: str, **facts) -> None:
    """ValueError naming the flag and the fix, for the first row of check `at` that holds."""
    hit = found(at, source, **facts)
    if hit is not None:
        raise ValueError(f"{where}: {said(*hit)}; {hit[0].fix}")


_NOT_BUILT = f"which the {FLAG} spec does not build"
_DROP = f"drop {FLAG} to let Megatron build it"
_TE = (("transformer_impl", "==", "transformer_engine"),)  # stock's local spec ignores these: so does ours
_LOW = (f"turns on Transformer Engine's FP4 GEMMs, FP8 parameters or FP8 attention, which the {FLAG} layers do "
        f"not run (their FP8 is the GEMMs of --fp8-format with --fp8-recipe tensorwise): the run would go without "
        f"it, silently")
_FP8 = (("fp8", "on", None),)  # under --fp8-format
_NO_FP8 = "drop --fp8-format, or drop --flash-overlap to use Transformer Engine's FP8"
_CP1 = ("Megatron's DotProductAttention implements it, at context parallel size 1 only: set "
        "--context-parallel-size 1, or use --softmax-type vanilla and no --window-size")
_DP = "add both flags, or write dp: {fuse: auto} (stock DDP where they are missing) or dp: {fuse: none}"
_DP_NEEDS = "the flash DP overlap needs --use-distributed-optimizer and --overlap-grad-reduce"
_ENTRY = "drop it, or run Megatron-LM's pretrain_gpt.py through flashoverlap-launch"


def _low(flag: str, field: str, args: str | None = None) -> Refusal:
    at = ("parse", "spec", "linear") if args else ("spec", "linear")
    return Refusal(flag, field, "on", None, _LOW, f"drop {flag}, or drop {FLAG} to use Transformer Engine's FP8/FP4",
                   at, args=args)


_FP8_ROWS = (
    Refusal("--fp8-recipe", "fp8_recipe", "not in", ("tensorwise", "delayed"),
            f"(block-scaled: MX, 1x128 blocks, or a custom quantizer) has no FP8 GEMM in the {FLAG} linears: they "
            f"run per-tensor scales (tensorwise: Transformer Engine's current scaling; delayed)",
            f"use --fp8-recipe tensorwise or delayed, or drop {FLAG} to use Transformer Engine's recipe",
            ("parse", "spec", "linear"), also=_FP8),
    Refusal("--recompute-granularity", "recompute_granularity", "==", "full",
            "with --fp8-recipe delayed: the recomputed forward would cast with scales updated since the first "
            "(our layers keep no copy of them for the recompute)",
            "use --fp8-recipe tensorwise, or --recompute-granularity selective, or no recompute",
            ("parse", "spec", "linear"), also=(("fp8", "on", None), ("fp8_recipe", "==", "delayed"))),
    Refusal("--fp8-format", "fp8", "on", None,
            "with --num-experts: the experts' GEMMs (Megatron's) have no FP8 path in our MoE layer",
            _NO_FP8, ("spec", "linear"), also=(("num_moe_experts", "on", None),)),
    Refusal("fp8_wgrad", "fp8_wgrad", "off", None,
            f"the weight gradients in high precision: the FP8 backward of the {FLAG} linears runs its wgrad GEMMs in "
            f"FP8", "leave fp8_wgrad True, or drop --fp8-format", ("spec", "linear"), also=_FP8),
    Refusal("--first-last-layers-bf16", "first_last_layers_bf16", "on", None,
            f"keeps the first and last layers in bf16, which the {FLAG} linears do not read (every layer would run "
            f"FP8)", "drop --first-last-layers-bf16, or drop --fp8-format", ("parse", "spec", "linear"), also=_FP8),
)


ROWS: tuple[Refusal, ...] = (
    Refusal("--spec", "spec", "not in", OUR_SPECS,
            f"was given, but {FLAG} selects its own layer spec ({' '.join(OUR_SPECS[0])})",
            f"drop --spec (or drop {FLAG} to keep your spec)", ("parse",)),
    Refusal("--tp-comm-overlap", "tp_comm_overlap", "on", None,
            f"asks for Transformer Engine's userbuffers, which {FLAG} replaces (they would still be initialized, "
            f"then unused)", "drop --tp-comm-overlap", ("parse",)),
    Refusal("--attention-backend", "attention_backend", "==", "local",
            f"is taken by Megatron-LM's validate_args only with --spec local (stock fails on it too: args.spec[0] of "
            f"no --spec, and 'local' is not an importable spec), and {FLAG} sets --spec. What it asks for, "
            f"Megatron's DotProductAttention, is what {FLAG} builds with --transformer-impl local and "
            f"--attention-backend auto (or any backend with attention: {{core: megatron}} in the YAML)",
            "drop --attention-backend local", ("parse",)),
    Refusal("--multi-latent-attention", "multi_latent_attention", "on", None,
            f"builds MLASelfAttention (its linears are not ours yet), {_NOT_BUILT}",
            f"drop --multi-latent-attention, or {_DROP}", ("spec", "local_spec")),
    Refusal("--experimental-attention-variant", "experimental_attention_variant", "on", None,
            f"builds its own block spec (gated delta net / DSA layers, --linear-attention-freq), {_NOT_BUILT}",
            f"drop --experimental-attention-variant, or {_DROP}", ("spec",)),
    Refusal("--heterogeneous-layers-config-path", "heterogeneous_block_specs", "on", None,
            f"(or -encoded-json) gives every layer its own config and spec, {_NOT_BUILT}",
            f"drop the heterogeneous layers config, or {_DROP}", ("spec",)),
    Refusal("--use-kitchen", "use_kitchen", "on", None,
            f"replaces the linears and attention with Kitchen's quantized ones, {_NOT_BUILT}",
            f"drop --use-kitchen, or {_DROP} (in code: get_gpt_layer_local_spec(use_kitchen=True))",
            ("spec", "local_spec")),
    Refusal("--transformer-impl", "transformer_impl", "==", "inference_optimized",
            f"builds Megatron's inference layers, {_NOT_BUILT}", "use --transformer-impl local or transformer_engine",
            ("spec",)),
    Refusal("--use-te-activation-func", "use_te_activation_func", "on", None,
            f"puts Transformer Engine's activation module in the MLP, {_NOT_BUILT}",
            "drop --use-te-activation-func (our MLP runs Megatron's activation)", ("spec",), also=_TE),
    Refusal("--use-grouped-gemm-for-dense-mlp", "use_grouped_gemm_for_dense_mlp", "on", None,
            f"builds Transformer Engine's fused dense MLP, {_NOT_BUILT}", "drop --use-grouped-gemm-for-dense-mlp",
            ("spec",), also=_TE),
    Refusal("--use-transformer-engine-op-fuser", "use_transformer_engine_op_fuser", "on", None,
            f"builds Transformer Engine's fused MLP, {_NOT_BUILT}", "drop --use-transformer-engine-op-fuser",
            ("spec",), also=_TE),
    Refusal("--use-kitchen-attention", "use_kitchen_attention", "on", None,
            f"replaces the attention with Kitchen's, {_NOT_BUILT}",
            "use Megatron's get_gpt_layer_local_spec(use_kitchen_attention=True) instead, or leave it False",
            ("local_spec",)),
    Refusal("--moe-use-legacy-grouped-gemm", "moe_use_legacy_grouped_gemm", "on", None,
            f"builds megatron-core 0.16's legacy GroupedMLP, {_NOT_BUILT}",
            "leave it False (moe_grouped_gemm is taken, as in get_gpt_layer_local_spec)", ("local_spec",)),
    *_FP8_ROWS,
    _low("--fp4-format", "fp4", "fp4"),
    _low("--fp8-param-gather", "fp8_param", "fp8_param_gather"),
    _low("--fp4-param-gather", "fp4_param", "fp4_param_gather"),
    _low("fp8_dot_product_attention", "fp8_dot_product_attention"),
    _low("fp8_multi_head_attention", "fp8_multi_head_attention"),
    Refusal("--moe-token-dispatcher-type", "moe_token_dispatcher_type", "==", "flex",
            "(the flex dispatcher: DeepEP / HybridEP / NCCL-EP) brings its own fused all-to-all kernels, which "
            "our MoE layer does not run",
            "use --moe-token-dispatcher-type alltoall (overlapped by us) or the stock spec", ("moe",)),
    Refusal("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm", "on", None,
            "(Megatron's 1F1B all-to-all overlap) is not composed with our exchange",
            "drop it (ours hides the exchange inside the layer) or use the stock spec", ("moe",)),
    Refusal("--normalization", "normalization", "not in", ("LayerNorm", "RMSNorm"),
            "is not implemented by SequenceParallelNorm (our torch norm)",
            "choose --normalization LayerNorm or RMSNorm", ("norm",)),
    Refusal("--memory-efficient-layer-norm", "memory_efficient_layer_norm", "on", None,
            "asks for apex's norm (backward from the output), which SequenceParallelNorm does not implement",
            "drop --memory-efficient-layer-norm, or install apex/Transformer Engine and use their norm", ("norm",)),
    Refusal("--cp-comm-type", "cp_comm_type", "not in", ("a2a",),
            "is not implemented by UlyssesDotProductAttention (our context parallelism is Ulysses, all-to-all)",
            "set --cp-comm-type a2a, or use the Transformer Engine spec for p2p/all_gather", ("ulysses",)),
    Refusal("--softmax-type", "softmax_type", "!=", "vanilla", "(a per-head softmax offset) is not implemented here",
            _CP1, ("ulysses", "stock_attention")),
    Refusal("--window-size", "window_size", "on", None, "(sliding-window attention) is not implemented here", _CP1,
            ("ulysses", "stock_attention")),
    Refusal("--apply-query-key-layer-scaling", "apply_query_key_layer_scaling", "on", None, "is not implemented here",
            "drop it (with an fp32 softmax it only rescales the scores)", ("ulysses", "query_split")),
    Refusal("--fp8-format", "fp8", "on", None, "has no FP8 GEMM in query-split attention (its projection would run "
            "in the model's dtype, silently)", "turn attention.query_split off, or drop --fp8-format", ("query_split",)),
    Refusal("--recompute-modules", "recompute_modules", "has", "core_attn",
            "checkpoints the core attention, which under query split is a stand-in: the pair's attention runs in "
            "linear_proj, outside that checkpoint, and keeps its probabilities for the backward as stock's does",
            "drop core_attn from --recompute-modules, or leave attention.query_split auto (Megatron's attention "
            "then, recomputed as asked)", ("query_split",),
            also=(("recompute_granularity", "==", "selective"),)),
    Refusal("--context-parallel-size", "context_parallel_size", ">", 1, "is not implemented by this core attention",
            "flashoverlap_layer_spec builds UlyssesDotProductAttention for it (--cp-comm-type a2a)",
            ("sdpa", "query_split")),
    Refusal("--use-distributed-optimizer", "use_distributed_optimizer", "off", None,
            f"the gradients are all-reduced, not reduce-scattered: {_DP_NEEDS}", _DP, ("dp",)),
    Refusal("--overlap-grad-reduce", "overlap_grad_reduce", "off", None,
            f"the reduce-scatter waits for the end of backward: {_DP_NEEDS}", _DP, ("dp",)),
    Refusal("--mock-data", "mock_data", "off", None, "it has no data (it trains on Megatron's mock GPT data)",
            "add --mock-data (for real data run Megatron-LM's pretrain_gpt.py through flashoverlap-launch)",
            ("entry",)),
    Refusal("--sft", "sft", "on", None, "asks for Megatron's SFT dataset, which this entry does not build (it "
            "trains on the mock GPT data)", _ENTRY, ("entry",)),
    Refusal("--inprocess-restart", "inprocess_restart", "on", None, "asks for NVRx's in-process restart, which this "
            "entry does not wrap pretrain() in", "drop it (the entry restarts nothing in process)", ("entry",)),
    Refusal("--pipeline-model-parallel-size", "pipeline_model_parallel_size", ">", 1,
            "is not run by this entry (it runs PP = CP = 1)", _ENTRY, ("entry",)),
    Refusal("--context-parallel-size", "context_parallel_size", ">", 1,
            "is not run by this entry (it runs PP = CP = 1)", _ENTRY, ("entry",)),
)

_SPELLED = {"fp8": "--fp8-format", "num_moe_experts": "--num-experts"}  # a field whose flag is not --<field>
_GIVEN = {"on": "`{f}`", "off": "no `{f}`", "==": "`{f} {v}`", "!=": "`{f}` other than `{v}`",
          "not in": "`{f}` other than {v}", ">": "`{f}` > {v}", "has": "`{f}` with `{v}`"}


def given(flag: str, op: str, value) -> str:
    """A condition in words, for the docs."""
    if op == "not in":
        value = ", ".join(f"`{' '.join(v) if isinstance(v, tuple) else v}`" for v in value)
    return _GIVEN[op].format(f=flag, v=value)


def markdown() -> str:
    """docs/megatron.md's table of refusals: one line per row."""
    lines = ["| Megatron flag | why | the fix | seen at |", "|---|---|---|---|"]
    for r in ROWS:
        also = "".join(f" with {given(_SPELLED.get(f, '--' + f.replace('_', '-')), o, x)}" for f, o, x in r.also)
        lines.append(f"| {given(r.flag, r.op, r.value)}{also} | {r.reason} | {r.fix} | "
                     f"{'; '.join(CHECKS[a] for a in r.at)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
