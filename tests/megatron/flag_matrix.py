"""The flag-set matrix's table: Megatron-LM's example configurations (examples/gpt3, llama, mixtral, gptoss; the
Qwen and DeepSeek recipes of its post-training configs) scaled down to 2 layers, hidden 64, sequence 32, 4
iterations, plus the parallel layouts and training options issue 26 lists, and FP8 (20 iterations against bf16).
Each row: Megatron's flags (fp32), the world size, what the --flash-overlap run's GEMM sites line must say (ours ran
where it should), and, where a known defect stops the row, the issue item that fixes it (the test is
xfail(strict=True): it flips when the fix lands). `jobs(row)`: the row's stock and flash runs; rows whose stock
arms are the same command share one run."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from tests.support.pretrain_runs import FLASH, LAST, Job

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
# FP8 against bf16 without FP8 (stock Megatron has FP8 only through Transformer Engine): the arms compute differently
# from the first forward, so no equality holds. Tolerance: 2^-4, e4m3's unit roundoff (the largest relative error
# of one FP8 cast), times what the bf16 run learned (its loss fall from iteration 1 to the last), at every
# iteration: the FP8 run may learn at most one e4m3 rounding more or less than bf16.
FP8_FALL_TOL = 2 ** -4
FP8_ITERS = 20
# one micro-batch of 2 and a narrow MLP: torch._scaled_mm on CPU runs ~25 M multiply-adds a second (~1000x slower
# than fp32), so an FP8 iteration costs its GEMMs' size; no dropout: the delayed row's resume replays the same steps
BF16 = (*TP2, *LLAMA, *NO_DROPOUT, "--bf16", "--global-batch-size", "2", "--ffn-hidden-size", "64")
TENSORWISE = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
DELAYED = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4",
           "--fp8-amax-compute-algo", "max")


def fp8_sites(recipe: str) -> str:
    return ", ".join(f"{site}=flash (FP8 hybrid {recipe})" for site in ("qkv", "proj", "fc1", "fc2"))


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    flags: tuple
    sites: str  # a substring of the flash run's GEMM sites line
    world: int = 2
    xfail: str | None = None  # the issue item whose fix this row waits for
    stock_flags: tuple | None = None  # the stock arm's flags where stock cannot run the same (CP, FP8)
    iters: int = ITERS
    fall_tol: float | None = None  # |flash - stock| <= fall_tol x stock's loss fall, where the arms differ (FP8)


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
    Row("fp8-tensorwise", (*BF16, *TENSORWISE), f"dense[1-2]: {fp8_sites('tensorwise')}", stock_flags=BF16,
        iters=FP8_ITERS, fall_tol=FP8_FALL_TOL),
    Row("fp8-delayed", (*BF16, *DELAYED), f"dense[1-2]: {fp8_sites('delayed')}", stock_flags=BF16,
        iters=FP8_ITERS, fall_tol=FP8_FALL_TOL),
)


def head(row: Row) -> tuple:
    """The launcher's argv up to the row's flags: --cpu, the script, BASE, and the row's --train-iters where it is not
    BASE's (argparse keeps the last)."""
    return ("--cpu", SCRIPT, *BASE, *(("--train-iters", str(row.iters)) if row.iters != ITERS else ()))


def jobs(row: Row) -> tuple:
    """(stock, flash) Jobs of a row; the stock job is named after the first row with the same stock command."""
    stock = (*head(row), *(row.stock_flags or row.flags))
    first = next(r for r in ROWS if (*head(r), *(r.stock_flags or r.flags)) == stock)
    return (Job(f"{first.name}-stock", "launch", stock, row.world, **_order(first)),
            Job(f"{row.name}-flash", "launch", (*head(row), *row.flags, *FLASH), row.world, **_order(row)))


def _order(row: Row) -> dict:
    return {"order": LAST} if row.xfail else {}  # an expected failure that hangs would end the batch
