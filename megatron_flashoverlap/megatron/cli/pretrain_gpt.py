"""The project entry: Megatron's own training loop (`megatron.training.pretrain`) on its mock GPT data, no
Megatron-LM checkout needed (megatron-core >= 0.17 ships `megatron.training`).

    python -m megatron_flashoverlap.pretrain_gpt [--cpu] [--nproc-per-node N] <megatron args> --mock-data
        [--flash-overlap [--flash-overlap-config configs/flash.yaml]]

The launcher's per-rank steps (`launch.prepare`: CPU defaults and shims with `--cpu`, our flags in Megatron's
`parse_args`), then Megatron-LM 0.19's GPT recipe: `parse_and_validate_args`, the model config and the
pretrain container from args (GPTModelBuilder builds the model, calling our spec under `--flash-overlap`),
`pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step)`. Megatron logs `lm loss`
every `--log-interval`; once the model is built rank 0 prints one line naming what each GEMM site of each layer
kind runs, and why where it is stock (megatron/sites.py, as the launcher does):

    GEMM sites: dense[1-2]: qkv=flash, proj=flash, fc1=flash, fc2=flash        (stock run: "GEMM sites: stock")

Written for the mock data (tokens / labels / loss_mask / position_ids / attention_mask per sample, every
rank builds the same samples, so no TP broadcast of the batch); PP = CP = 1. What Megatron-LM's pretrain_gpt.py
reads of its flags for mock data, this entry reads too: the dataset config's fields (--data-cache-path, the
validation sets, the position / mask resets, ...; real data's blends aside) and the loss checks
(--check-for-nan-in-loss-and-grad, --check-for-spiky-loss); what it cannot honour (--sft, --inprocess-restart,
real data, PP, CP) is refused (config/refusals.py). For real data, PP, CP or SFT, run Megatron-LM's own
`pretrain_gpt.py` through `flashoverlap-launch`.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ...config.refusals import refuse
from . import launch

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def datasets_provider(num_samples, vp_stage=None):
    """(train, valid, test) MockGPTDatasets of Megatron's sizes `num_samples`, built on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(  # every field Megatron-LM's pretrain_gpt.py sets from its flags, but the blends
        random_seed=args.seed, sequence_length=args.seq_length, split=args.split, tokenizer=get_tokenizer(),
        multiple_validation_sets=args.multiple_validation_sets, full_validation=args.full_validation,
        path_to_cache=args.data_cache_path, num_dataset_builder_threads=args.num_dataset_builder_threads,
        mmap_bin_files=args.mmap_bin_files, object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens, fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True  # Megatron calls it on every rank, not on TP rank 0 only


SPIKY_LOSS_FACTOR = 10  # Megatron-LM's pretrain_gpt.py: a loss 10x the largest one seen so far is spiky


def check_loss(loss: torch.Tensor) -> None:
    """The checks Megatron-LM's pretrain_gpt.py makes of a micro-batch's local loss (before the DP reduction),
    where its flags ask for them, through Megatron's rerun state machine: --check-for-nan-in-loss-and-grad (on
    by default) ends the run on a NaN or Inf loss; --check-for-spiky-loss flags a loss over SPIKY_LOSS_FACTOR
    times the largest seen."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args, machine = get_args(), get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for rejected, word in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=rejected, tolerance=0.0, fatal=True,
                                    message=f"found {word} in local forward loss calculation")
    if args.check_for_spiky_loss:
        spiky = functools.partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss")
        machine.validate_result(result=loss, rejection_func=spiky, message="Spiky loss", tolerance=0.0, fatal=False)


def loss_func(loss_mask: torch.Tensor, per_token: torch.Tensor):
    """(summed loss, token count, {"lm loss": [sum, count]}): the triple Megatron's schedules average, the loss
    checked first (check_loss)."""
    mask = loss_mask.reshape(-1).float()
    loss = (per_token.reshape(-1).float() * mask).sum()
    count = mask.sum().to(torch.int)
    check_loss(loss)
    return loss, count, {"lm loss": torch.cat([loss.detach().view(1), count.view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch [b, s] through the model; -> (per-token loss [b, s], loss_func)."""
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: batch[k].to(device) if batch.get(k) is not None else None for k in BATCH_KEYS}
    per_token = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                      loss_mask=batch["loss_mask"])
    return per_token, functools.partial(loss_func, batch["loss_mask"])


def run() -> None:
    """One rank, `sys.argv` prepared: Megatron-LM 0.19's GPT recipe around `pretrain` (launch.prepare installed
    the sites line)."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    refuse("entry", args, "megatron_flashoverlap.pretrain_gpt")  # config/refusals.py: --mock-data, PP = CP = 1
    container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`argv` = [--cpu] [--nproc-per-node N] <megatron args> (launch.run_entry)."""
    launch.run_entry("megatron_flashoverlap.pretrain_gpt", "pretrain_gpt", run, argv)


if __name__ == "__main__":
    main()
