"""Deliberate defects in the shipped code, each named, each with the tests that must FAIL under it.

A test that cannot fail proves nothing; each mutation here breaks ONE thing in the package (a broken ring, a
skipped DP shard, a wrong decode all-reduce, ...) and lists the tests that claim to guard against it.

    python -m tests.support.mutations --list                 the mutations and their tests
    python -m tests.support.mutations NAME [--control]       run NAME's tests under it: each must FAIL;
                                                             --control: also without it, each must PASS
    pytest --mutation NAME tests/...                         any test under one mutation (conftest.py)

How it reaches the code: `--mutation NAME` applies NAME in the pytest process (pytest_configure, before the
test modules are imported) and exports FLASHOVERLAP_TEST_MUTATION=NAME, which every gloo pool worker and every
rank of the shared pretrain() start-up reads at start (tests/support/pool.py, pretrain_runner.py) and applies in
its own process. A mutation replaces a function or method
where it is defined AND in every loaded module that imported it by name (`_replace`), so the call sites the
tests reach all see it. Nothing here runs unless asked: a normal test run has no mutation.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Callable

ENV = "FLASHOVERLAP_TEST_MUTATION"


@dataclass(frozen=True)
class Mutation:
    what: str  # the defect, in one line
    tests: tuple[str, ...]  # pytest node ids that must fail under it
    apply: Callable[[], list]  # patches the package; -> undo callbacks


def _replace(module: str, name: str, new) -> list:
    """Replace attribute `name` of `module` (a function or class attribute path 'Cls.attr') by `new`, and every
    by-name import of the old function in the loaded megatron_flashoverlap.* / tests.* modules. -> undo list."""
    mod = importlib.import_module(module)
    owner, attr = mod, name
    if "." in name:
        cls, attr = name.split(".")
        owner = getattr(mod, cls)
    old = getattr(owner, attr)
    undo = [lambda: setattr(owner, attr, old)]
    setattr(owner, attr, new)
    if owner is mod:
        for m in list(sys.modules.values()):
            mn = getattr(m, "__name__", "") or ""
            if m is mod or not mn.startswith(("megatron_flashoverlap", "tests")):
                continue
            for k, v in list(vars(m).items()):
                if v is old:
                    setattr(m, k, new)
                    undo.append(lambda m=m, k=k: setattr(m, k, old))
    return undo


# ---- the mutations -------------------------------------------------------------------------------------------

def _merge_drops_recvs() -> list:
    from megatron_flashoverlap.schedules.step import Step

    def merge(*schedules):
        n = max(len(s.steps) for s in schedules)
        out = []
        for i in range(n):
            parts = [s.steps[i] for s in schedules if i < len(s.steps)]
            out.append(Step(sends=tuple(t for p in parts for t in p.sends),
                            recvs=tuple(t for p in parts[:1] for t in p.recvs),  # DEFECT: later schedules' recvs lost
                            compute=tuple(c for p in parts for c in p.compute)))
        return tuple(out)
    return _replace("megatron_flashoverlap.schedules.step", "merge", merge) + \
        _replace("megatron_flashoverlap.schedules", "merge", merge)


def _fp16_sums_in_bf16() -> list:
    import torch

    from megatron_flashoverlap.runtime import numerics

    def acc_dtype(dtype):  # DEFECT: fp16 partial sums kept in bf16 (3 mantissa bits fewer than fp16 itself)
        return torch.bfloat16 if dtype == torch.float16 else (torch.float32 if dtype == torch.bfloat16 else dtype)
    numerics.sums.cache_clear()
    undo = _replace("megatron_flashoverlap.runtime.numerics", "acc_dtype", acc_dtype)
    return undo + [numerics.sums.cache_clear]


def _causal_mask_hides_diagonal() -> list:
    """The shared attention kernel's causal rule also masks the key at the query's own position."""
    import torch

    from megatron_flashoverlap.ops.attention.core import AttnSpec

    def rows_mask(self, a, b, sk, device):
        out = None if self.mask is None else self.mask[..., a:b, :]
        if self.causal:
            if self.positions is None:
                qp, kp = torch.arange(a, b, device=device), torch.arange(sk, device=device)
            else:
                qp, kp = self.positions[a:b].to(device), self.positions.to(device)
            c = kp[None, :] >= qp[:, None]  # DEFECT: >= (the diagonal masked too), not >
            out = c if out is None else (out | c)
        return out
    return _replace("megatron_flashoverlap.ops.attention.core", "AttnSpec.rows_mask", rows_mask)


def _threaded_recv_lost() -> list:
    """Posts on the communication thread (gloo's default path) receive into copies: the buffers the operator
    reads are never filled. The profiler's in-caller path (threaded() False) stays right."""
    from megatron_flashoverlap.runtime.commthread import comm_thread, threaded

    def post(self, step, sends, send_peers, recvs, recv_peers):
        if self.threaded and threaded():
            lost = [r.clone() for r in recvs]  # DEFECT
            return comm_thread(self.pg).submit(lambda: self._post(step, sends, send_peers, lost, recv_peers))
        return self._post(step, sends, send_peers, recvs, recv_peers)
    return _replace("megatron_flashoverlap.runtime.transport", "Link.post", post)


def _decode_all_reduce_off_by_a_permille() -> list:
    """The row-parallel decode branch's all-reduce returns the sum times (1 + 1e-3): wrong, same on every rank."""
    from megatron_flashoverlap.ops.all_reduce.all_reduce import all_reduce

    def wrong(x, group=None, **kw):
        return all_reduce(x, group, **kw) * (1 + 1e-3)  # DEFECT
    return _replace("megatron_flashoverlap.ops.tp_nosp.autograd", "all_reduce", wrong)


def _chooser_prefers_slower() -> list:
    """The chooser's rule takes the slowest candidate (by median), whatever stock measured."""
    import statistics

    def pick(samples, stock="reference"):
        slowest = max(samples, key=lambda k: statistics.median(samples[k]))
        return slowest, "mutated: the slowest"
    return _replace("megatron_flashoverlap.plan.chooser", "paired_pick", pick)


def _decode_branch_off() -> list:
    """Decode-shaped inputs no longer take the decode all-reduce (the shipped branch is never entered)."""
    return _replace("megatron_flashoverlap.ops.tp_nosp.autograd", "_decode_branch",
                    lambda x, plan: False)  # DEFECT


def _produce_span(scale_dw: float = 1.0, skip_rank: int | None = None):
    """A produce_span_into whose dW part is scaled, or skipped on global rank `skip_rank` for the bucket's
    first shard-span (the span starting at 0)."""
    import torch.distributed as dist

    from megatron_flashoverlap.ops.dp import wgrad_rs

    orig = wgrad_rs.produce_span_into

    def produce(dy, x, bucket, a, b, out):
        if skip_rank is not None and a == 0 and dist.get_rank() == skip_rank:
            out.copy_(bucket.grad_flat[a:b])  # DEFECT: this rank's dW left out of the shard
            if bucket.scale != 1.0:
                out.mul_(bucket.scale)
            return
        orig(dy * scale_dw if scale_dw != 1.0 else dy, x, bucket, a, b, out)  # DEFECT where scale_dw != 1
    return produce


def _dp_skip_fused_shard() -> list:
    return _replace("megatron_flashoverlap.ops.dp.wgrad_rs", "produce_span_into", _produce_span(skip_rank=1))


def _dp_fused_grad_one_percent_low() -> list:
    return _replace("megatron_flashoverlap.ops.dp.wgrad_rs", "produce_span_into", _produce_span(scale_dw=0.99))


def _dp_fused_grad_five_percent_low() -> list:
    return _replace("megatron_flashoverlap.ops.dp.wgrad_rs", "produce_span_into", _produce_span(scale_dw=0.95))


def _cost_model_fuses_nothing() -> list:
    from megatron_flashoverlap.megatron.ddp import auto_fuse

    orig = auto_fuse.choose

    def choose(grads, bucket_size, link, asynchronous=False):
        k, best, stock = orig(grads, bucket_size, link, asynchronous)
        return 0, stock, stock  # DEFECT: whatever the model finds, nothing fused
    return _replace("megatron_flashoverlap.megatron.ddp.auto_fuse", "choose", choose)


class _ScaleGrad:
    """Identity forward; the gradient times `factor` (a 1 % wrong gradient that leaves the forward exact)."""

    @staticmethod
    def make(factor):
        import torch

        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.view_as(t)

            @staticmethod
            def backward(ctx, g):
                return g * factor
        return F.apply


def _ulysses_dq_one_percent_high() -> list:
    from megatron_flashoverlap.ops.attention.core import attention_rows

    scale = _ScaleGrad.make(1.01)

    def rows(q, k, v, spec, a=0):
        return attention_rows(scale(q), k, v, spec, a)  # DEFECT: dq 1 % too large, forward exact
    return _replace("megatron_flashoverlap.ops.attention.ulysses", "attention_rows", rows)


def _query_split_dw_one_percent_high() -> list:
    from megatron_flashoverlap.ops.attention import query_split

    orig = query_split.query_split_backward_ring

    def backward(*args):
        dq, dk, dv, dw = orig(*args)
        return dq, dk, dv, dw * 1.01  # DEFECT: linear_proj's dW 1 % too large
    return _replace("megatron_flashoverlap.ops.attention.query_split", "query_split_backward_ring", backward)


def _ulysses_extra_parameter() -> list:
    """The shipped CP core attention registers a parameter stock's has not (a checkpoint would not load)."""
    import torch

    from megatron_flashoverlap.megatron.attention import UlyssesDotProductAttention

    orig = UlyssesDotProductAttention.__init__

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.stray = torch.nn.Parameter(torch.zeros(1))  # DEFECT
    return _replace("megatron_flashoverlap.megatron.attention", "UlyssesDotProductAttention.__init__", init)


def _flash_overlap_flag_ignored() -> list:
    """`--flash-overlap` parsed and then ignored: the run builds stock's layers (a silently stock model)."""
    return _replace("megatron_flashoverlap.megatron.cli.args", "apply_flash_overlap_args",
                    lambda args: args)  # DEFECT


def _fp8_dequantized_twice() -> list:
    """Every FP8 GEMM dequantizes with twice the input's scale_inv (a margin of 1 taken off the dequantization, not
    the cast): each FP8 product comes out 2x."""
    from megatron_flashoverlap.runtime import scaled_mm as sm
    real = sm.scaled_mm
    return _replace("megatron_flashoverlap.runtime.scaled_mm", "scaled_mm",
                    lambda a, b, sa, sb, dtype, bias=None, out=None: real(a, b, sa * 2, sb, dtype, bias, out))  # DEFECT


_S = "tests/pure/test_schedules.py::"
_O = "tests/gloo/test_ops.py::"
_U = "tests/gloo/test_attention_ulysses.py::"
_M = "tests/gloo/test_moe_pipeline.py::"
_D = "tests/megatron/test_allreduce_decode.py::test_greedy_decode_matches_stock"
_G = "tests/megatron/test_attention_gpt.py::"

MUTATIONS: dict[str, Mutation] = {
    "merge_drops_recvs": Mutation(
        "schedules.merge loses the receives of every merged schedule but the first",
        (_S + "test_merged_backward_walk_validates_per_tag[3]",), _merge_drops_recvs),
    "fp16_sums_in_bf16": Mutation(
        "reduce-scatter partial sums of fp16 inputs kept in bf16 (acc_dtype)",
        (_O + "test_low_precision[flash-float16]", _O + "test_low_precision[flash_bidir-float16]"),
        _fp16_sums_in_bf16),
    "causal_mask_hides_diagonal": Mutation(
        "the attention kernel (core.AttnSpec.rows_mask) masks each query's own key too",
        (_U + "test_ulysses_zigzag_causal_matches_full_attention[flash-2]",
         _U + "test_ulysses_padding_mask_rows_gathered[True]", _U + "test_ulysses_gqa_and_bf16"),
        _causal_mask_hides_diagonal),
    "threaded_recv_lost": Mutation(
        "gloo's communication-thread posts receive into copies (the default path; the profiler's is right)",
        (_M + "test_pipeline_matches_expected_uneven_and_zero_counts[flash-2]",
         _M + "test_pipeline_without_zeros[2]"), _threaded_recv_lost),
    "decode_all_reduce_off_by_a_permille": Mutation(
        "the row-parallel decode all-reduce returns the sum times 1.001",
        (_D + "[2-auto-None-1]", _D + "[4-recursive_doubling-None-2]"), _decode_all_reduce_off_by_a_permille),
    "chooser_prefers_slower": Mutation(
        "the chooser's paired rule (plan/chooser.paired_pick) takes the slowest candidate",
        ("tests/pure/test_chooser.py::test_stock_wins_unless_a_candidate_wins_the_paired_rounds",
         "tests/gloo/test_allreduce_startup.py::test_a_candidate_slow_on_one_rank_is_taken_by_no_rank"),
        _chooser_prefers_slower),
    "decode_branch_off": Mutation(
        "decode-shaped inputs skip the decode all-reduce branch of matmul_all_reduce",
        (_D + "[2-auto-None-1]",), _decode_branch_off),
    "dp_skip_fused_shard": Mutation(
        "the fused DP reduce-scatter leaves global rank 1's dW out of the bucket's first shard",
        ("tests/megatron/test_ddp.py::test_bf16_params_fp32_grad_buffers",), _dp_skip_fused_shard),
    "dp_fused_grad_five_percent_low": Mutation(
        "the fused DP reduce-scatter's dW is 5 % too small",
        ("tests/megatron/test_ddp.py::test_bf16_params_fp32_grad_buffers",), _dp_fused_grad_five_percent_low),
    "dp_fused_grad_one_percent_low": Mutation(
        "the fused DP reduce-scatter's dW is 1 % too small",
        ("tests/megatron/test_ddp_gpt.py::test_explicit_choice",), _dp_fused_grad_one_percent_low),
    "cost_model_fuses_nothing": Mutation(
        "the DP cost model (plan/dp.choose, as megatron/ddp/auto_fuse calls it) picks no linear, whatever its rates",
        ("tests/megatron/test_ddp_gpt.py::test_cost_model_choice_is_logged_and_trains_like_stock[1]",),
        _cost_model_fuses_nothing),
    "ulysses_dq_one_percent_high": Mutation(
        "Ulysses core attention's dq 1 % too large (forward exact)",
        (_G + "test_gpt_cp2_ulysses_matches_no_cp[flash]",), _ulysses_dq_one_percent_high),
    "query_split_dw_one_percent_high": Mutation(
        "the query-split backward's linear_proj dW 1 % too large (forward exact)",
        (_G + "test_gpt_tp2_query_split_matches_local_spec[flash]",), _query_split_dw_one_percent_high),
    "flash_overlap_flag_ignored": Mutation(
        "the launcher parses --flash-overlap and ignores it (stock's layers built)",
        ("tests/megatron/test_pretrain.py::test_launcher_runs_an_unmodified_pretrain_script_on_cpu",),
        _flash_overlap_flag_ignored),
    "fp8_dequantized_twice": Mutation(
        "every FP8 GEMM's product 2x its value (the input's scale_inv doubled)",
        tuple(f"tests/megatron/test_flag_matrix.py::test_flash_overlap_logs_stocks_loss_at_every_iteration[{r}]"
              for r in ("fp8-tensorwise", "fp8-delayed")), _fp8_dequantized_twice),
    "ulysses_extra_parameter": Mutation(
        "UlyssesDotProductAttention registers a parameter the stock core attention has not",
        (_G + "test_gpt_cp2_default_causal_mask_and_gqa",), _ulysses_extra_parameter),
}


@contextlib.contextmanager
def mutated(name: str):
    """Apply mutation `name` in this process for the duration of the block."""
    undo = MUTATIONS[name].apply()
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def apply_from_env() -> str | None:
    """In a worker: apply the mutation named by FLASHOVERLAP_TEST_MUTATION (for the process's lifetime)."""
    name = os.environ.get(ENV)
    if name:
        MUTATIONS[name].apply()
    return name


def _outcomes(ids, name: str | None) -> dict:
    """Run pytest on `ids` (under mutation `name`, or none) -> {node id: "passed" | "failed" | "skipped"}."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "r.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *ids]
        if name:
            cmd += ["--mutation", name]
        subprocess.run(cmd, check=False)
        out = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            mod = case.get("classname").replace(".", "/") + ".py"
            status = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    status = "failed"
                elif child.tag == "skipped":
                    status = "skipped"
            out[f"{mod}::{case.get('name')}"] = status
        return out


def check(name: str, control: bool = False) -> bool:
    """Every test of mutation `name` fails under it (and, with control, passes without it)."""
    m = MUTATIONS[name]
    ok = True
    runs = [(name, "failed")] + ([(None, "passed")] if control else [])
    for mut, want in runs:
        got = _outcomes(m.tests, mut)
        for t in m.tests:
            status = got.get(t, "not run")
            good = status == want
            ok &= good
            print(f"{'ok ' if good else 'BAD'} {t}: {status} {'under ' + name if mut else 'without a mutation'}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", choices=sorted(MUTATIONS))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--control", action="store_true", help="also run the tests without the mutation: must pass")
    a = ap.parse_args(argv)
    if a.list or not a.name:
        for n, m in MUTATIONS.items():
            print(f"{n}: {m.what}\n    " + "\n    ".join(m.tests))
        return 0
    return 0 if check(a.name, a.control) else 1


if __name__ == "__main__":
    sys.exit(main())
