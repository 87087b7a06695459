"""The flag-set matrix's table: Megatron-LM's example configurations (examples/gpt3, llama, mixtral, gptoss; the
Qwen and DeepSeek recipes of its post-training configs) scaled down to 2 layers, hidden 64, sequence 32, 4
iterations, plus the parallel layouts and training options issue 26 lists. Each row: Megatron's flags (fp32), the
world size, what the --flash-overlap run's GEMM sites line must say (ours ran where it should), and, where a known
defect stops the row, the issue item that fixes it (the test is xfail(strict=True): it flips when the fix lands)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

SCRIPT = str(Path(__file__).with_name("pretrain_script.py"))
ITERS = 4
BASE = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", str(ITERS), "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", "1000", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data",
        "--seed", "1234")
TP2 = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
ROPE_GQA = ("--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2")
LLAMA = (*ROPE_GQA, "--swiglu")
NO_FUSED_SOFTMAX = ("--no-masked-softmax-fusion",)  # as Megatron-LM's Llama-style scripts set it (--cpu adds it too)
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-ffn-hidden-size", "32", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1")
EP2_TP2 = (*TP2, *MOE)  # dense layers TP=2 + SP, experts EP=2 x expert-TP=1 (Megatron's MoE parallel folding)
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")
DENSE = "qkv=flash, proj=flash, fc1=flash, fc2=flash"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    flags: tuple
    sites: str  # a substring of the flash run's GEMM sites line
    world: int = 2
    xfail: str | None = None  # the issue item whose fix this row waits for
    stock_flags: tuple | None = None  # the stock arm's flags where stock cannot run the same (CP)


ROWS = (
    Row("gpt3", (*TP2, "--init-method-std", "0.006", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2",
                 "0.95", "--weight-decay", "0.1", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
                 "--attention-backend", "auto"), f"dense[1-2]: {DENSE}"),
    Row("llama3", (*TP2, *LLAMA, *NO_FUSED_SOFTMAX, "--ffn-hidden-size", "160", "--rotary-base", "1000000",
                   "--init-method-std", "0.0134", "--attention-backend", "fused", "--attention-dropout", "0.0",
                   "--hidden-dropout", "0.0"), f"dense[1-2]: {DENSE}"),
    Row("qwen", (*TP2, *LLAMA, *NO_FUSED_SOFTMAX, "--qk-layernorm", "--add-qkv-bias", "--rotary-base", "1000000"),
        f"dense[1-2]: {DENSE}"),
    Row("mixtral-ep2", (*EP2_TP2, *LLAMA, *NO_FUSED_SOFTMAX, "--moe-router-load-balancing-type", "aux_loss",
                        "--moe-aux-loss-coeff", "1e-2"), "ep_a2a=flash"),
    Row("deepseek-freq", (*EP2_TP2, *LLAMA, *NO_FUSED_SOFTMAX, "--moe-layer-freq", "([0]+[1]*1)",
                          "--moe-shared-expert-intermediate-size", "64", "--moe-router-load-balancing-type",
                          "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3"), "ep_a2a=flash"),
    Row("gptoss", (*EP2_TP2, *ROPE_GQA, *NO_FUSED_SOFTMAX, "--softmax-type", "learnable", "--window-size", "15,0",
                   "--window-attn-skip-freq", "2", "--quick-geglu", "--glu-linear-offset", "1.0",
                   "--activation-func-clamp-value", "7.0", "--moe-router-load-balancing-type", "aux_loss",
                   "--moe-aux-loss-coeff", "1e-3", "--moe-z-loss-coeff", "1e-3", "--moe-router-dtype", "fp32"),
        "ep_a2a=flash"),
    Row("tp2-nosp-seq63", ("--tensor-model-parallel-size", "2", "--seq-length", "63", "--max-position-embeddings",
                           "64"), "proj="),
    Row("recompute-full", (*TP2, *LLAMA, *NO_FUSED_SOFTMAX, "--recompute-granularity", "full", "--recompute-method",
                           "uniform", "--recompute-num-layers", "1"), f"dense[1-2]: {DENSE}"),
    Row("recompute-selective-dropout", (*TP2, "--recompute-granularity", "selective", "--attention-dropout", "0.1",
                                        "--hidden-dropout", "0.1"), f"dense[1-2]: {DENSE}"),
    Row("per-token-reset", (*TP2, "--calculate-per-token-loss", "--reset-position-ids", "--reset-attention-mask",
                            "--eod-mask-loss"), f"dense[1-2]: {DENSE}"),
    Row("pp2-tp2", (*TP2, "--pipeline-model-parallel-size", "2"), DENSE, world=4),
    Row("vpp2-tp2", (*TP2, "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                     "--num-layers-per-virtual-pipeline-stage", "1"), DENSE, world=4),
    Row("tp2-dp2-distopt", (*TP2, "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"),
        f"dense[1-2]: {DENSE}", world=4),
    Row("bf16-distopt", (*TP2, *LLAMA, *NO_FUSED_SOFTMAX, "--bf16", "--use-distributed-optimizer"),
        f"dense[1-2]: {DENSE}"),
    # Ulysses splits heads and key/value groups over TP x CP = 4: 4 groups; stock: CP=1 x DP=2, the same batch;
    # no dropout (a CP rank holds other positions than a DP rank: other masks)
    Row("cp2-a2a-tp2", (*TP2, "--context-parallel-size", "2", "--cp-comm-type", "a2a", *LLAMA, *NO_FUSED_SOFTMAX,
                        *NO_DROPOUT, "--num-query-groups", "4"), f"dense[1-2]: {DENSE}", world=4,
        stock_flags=(*TP2, *LLAMA, *NO_FUSED_SOFTMAX, *NO_DROPOUT, "--num-query-groups", "4")),
    Row("bf16", (*TP2, *LLAMA, "--bf16"), f"dense[1-2]: {DENSE}"),  # no distributed optimizer (issue 26 item 5)
)
