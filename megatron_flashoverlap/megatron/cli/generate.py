"""The project's inference entry: what Megatron-LM's `examples/inference/offline_inference.py` does, through the
megatron-core wheel's own API (no Megatron-LM checkout: the wheel ships megatron.core.inference and
megatron.training, not the checkout's megatron/inference helpers).

    python -m megatron_flashoverlap.generate [--cpu] [--nproc-per-node N] <megatron model args>
        --load CKPT [--prompts "0 5 9 17" ...  |  --num-prompts 8 --prompt-length-range 4 24]
        [--num-tokens-to-generate 16] [--output-path out.json] [--flash-overlap [--flash-overlap-config F]]

Per rank: the launcher's steps (`launch.prepare`: CPU defaults and shims with `--cpu`, our flags in Megatron's
parse_args), `initialize_megatron`, the model from Megatron's GPTModelBuilder (our spec under --flash-overlap),
the checkpoint through Megatron's `load_checkpoint` (one saved by pretrain_gpt.py, stock or --flash-overlap:
the parameters are the same), the GEMM sites line, then `MegatronLLM` (the dynamic engine, direct mode: every
rank drives it with the same prompts) generating greedily (top-k 1). Rank 0 prints one line per request:

    request 0 | prompt 7 tokens | generated 16: 12 7 99 ...

Prompts are token ids (`--prompts`, space separated; or `--num-prompts` random ones, lengths drawn from
`--prompt-length-range`, seeded by --seed): text prompts need a tokenizer with a BOS id, which Megatron's
NullTokenizer lacks.
"""
from __future__ import annotations

import json
import random
from typing import Optional, Sequence

from . import launch


def add_generate_args(parser):
    """Megatron's argparse parser + this entry's flags (offline_inference.py's names where they exist)."""
    group = parser.add_argument_group(title="megatron_flashoverlap.generate")
    group.add_argument("--prompts", nargs="+", default=None, help="prompts as space-separated token ids")
    group.add_argument("--num-prompts", type=int, default=4, help="random prompts when --prompts is not given")
    group.add_argument("--prompt-length-range", type=int, nargs=2, default=[4, 24], metavar=("MIN", "MAX"))
    group.add_argument("--num-tokens-to-generate", type=int, default=16)
    group.add_argument("--output-path", default=None, help="write the requests' tokens and log-probs as JSON")
    return parser


def prompt_tokens(args, vocab_size: int) -> list[list[int]]:
    """--prompts parsed, or --num-prompts seeded random prompts (ids 1 .. vocab - 2: no 0, no eod)."""
    if args.prompts:
        try:
            return [[int(t) for t in p.split()] for p in args.prompts]
        except ValueError as err:
            raise SystemExit(f"--prompts: token ids separated by spaces, e.g. --prompts \"0 5 9\" ({err})") from err
    low, high = args.prompt_length_range
    if not 1 <= low <= high:
        raise SystemExit(f"--prompt-length-range {low} {high}: need 1 <= MIN <= MAX")
    rng = random.Random(args.seed)
    return [[rng.randint(1, vocab_size - 2) for _ in range(rng.randint(low, high))] for _ in range(args.num_prompts)]


def load_model(args):
    """GPTModelBuilder's model for these args (our spec under --flash-overlap), the checkpoint loaded, eval."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.models import GPTModelBuilder

    if args.load is None:
        raise SystemExit("--load CKPT is required: a checkpoint saved by pretrain_gpt.py (--save)")
    models = GPTModelBuilder(gpt_config_from_args(args)).build_distributed_models(
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False)
    args.exit_on_missing_checkpoint = True
    load_checkpoint(ddp_model=models, optimizer=None, opt_param_scheduler=None, strict=True)
    return models[0].eval()


def generate(args, model, prompts: list[list[int]]) -> list[dict]:
    """MegatronLLM (direct mode) over `prompts`, greedy -> [{prompt, tokens, log_probs}] in prompt order."""
    from megatron.core.inference.apis import MegatronLLM
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    tokenizer = build_tokenizer(args)
    config = inference_config(args, model)
    config.max_sequence_length = max(map(len, prompts)) + args.num_tokens_to_generate
    sampling = SamplingParams(temperature=1.0, top_k=1, return_log_probs=True, skip_prompt_log_probs=True,
                              num_tokens_to_generate=args.num_tokens_to_generate, termination_id=tokenizer.eod)
    with MegatronLLM(model=model, tokenizer=tokenizer, inference_config=config, use_coordinator=False) as llm:
        done = llm.generate(prompts, sampling)
    return [{"prompt": p, "tokens": [int(t) for t in r.generated_tokens],
             "log_probs": [float(x) for x in (r.generated_log_probs or [])]} for p, r in zip(prompts, done)]


def report(results: list[dict], output_path: Optional[str]) -> None:
    """Rank 0: one line per request (and the JSON file)."""
    for i, r in enumerate(results):
        print(f"request {i} | prompt {len(r['prompt'])} tokens | generated {len(r['tokens'])}: "
              + " ".join(map(str, r["tokens"])), flush=True)
    if output_path:
        with open(output_path, "w") as f:
            json.dump(results, f)


def inference_config(args, model):
    """Megatron's runtime InferenceConfig from the args (no CUDA graphs: the CPU path has none)."""
    from megatron.training.argument_utils import inference_cfg_from_args

    return inference_cfg_from_args(args).to_inference_config(model, enable_cuda_graphs=False, verbose=False)


def loaded_model(extra_args_provider):
    """Megatron's args (with an entry's flags), initialize_megatron, the checkpoint's model -> (args, model)."""
    from megatron.training import get_args, initialize_megatron
    from megatron.training.arguments import parse_and_validate_args

    parse_and_validate_args(extra_args_provider=extra_args_provider,
                            args_defaults={"no_load_rng": True, "no_load_optim": True})
    initialize_megatron()
    args = get_args()
    return args, load_model(args)


def run() -> None:
    """One rank, `sys.argv` prepared (launch.prepare)."""
    import torch.distributed as dist

    from .. import sites

    args, model = loaded_model(add_generate_args)
    line = sites.sites_line([model])
    results = generate(args, model, prompt_tokens(args, args.vocab_size or args.padded_vocab_size))
    if dist.get_rank() == 0:
        print(line, flush=True)
        report(results, args.output_path)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`argv` = [--cpu] [--nproc-per-node N] <megatron args and this entry's flags> (launch.run_entry)."""
    launch.run_entry("megatron_flashoverlap.generate", "generate", run, argv)


if __name__ == "__main__":
    main()
