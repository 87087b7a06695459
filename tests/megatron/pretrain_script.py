"""A pretrain script of the tests' own, for the launcher: what Megatron-LM 0.19's pretrain_gpt.py does with
megatron.training (parse, model config, pretrain container, pretrain) on mock data, in a few lines, and
unaware of megatron_flashoverlap: the launcher alone adds --flash-overlap and --cpu. As Megatron-LM's: the
dataset honours --reset-position-ids / --reset-attention-mask / --eod-mask-loss, each context-parallel rank
keeps its (zigzag) share of the sequence (get_batch_on_this_cp_rank)."""
import functools

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.utils import get_batch_on_this_cp_rank
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def datasets(num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, split=args.split,
                              tokenizer=get_tokenizer(), path_to_cache=args.data_cache_path,
                              num_dataset_builder_threads=args.num_dataset_builder_threads,
                              reset_position_ids=args.reset_position_ids,
                              reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
                              create_attention_mask=args.create_attention_mask_in_dataloader)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


datasets.is_distributed = True  # every rank builds the same mock samples: no TP broadcast needed


def loss(mask, per_token):
    mask = mask.reshape(-1).float()
    total = (per_token.reshape(-1).float() * mask).sum()
    count = mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.cat([total.detach().view(1), count.view(1)])}


def forward_step(data_iterator, model):
    b = next(data_iterator)
    b = {k: b[k].cuda() if b.get(k) is not None else None for k in KEYS}  # as on GPU
    b = get_batch_on_this_cp_rank({**b, "cu_seqlens": None}, is_hybrid_cp=False,
                                  cp_group=parallel_state.get_context_parallel_group())
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"], loss_mask=b["loss_mask"])
    return out, functools.partial(loss, b["loss_mask"])


if __name__ == "__main__":
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), datasets,
             ModelType.encoder_or_decoder, forward_step)
