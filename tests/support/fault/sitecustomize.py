"""A test-only fault: the rank FAULT_RANK stops itself (SIGSTOP, as `kill -STOP` would) before its FAULT_CALL-th
post of one of our transfers made inside the function FAULT_IN (a frame's qualified name, e.g.
"AllGatherMatmul.forward", "MatmulReduceScatter.backward", "matmul_wgrad_reduce_scatter").

Every post counts, whatever its ring step: a ring's first transfer is not always at step 0 (the reduce-scatter
ring of 2 ranks computes at step 0 and posts at step 1: `python -m megatron_flashoverlap.schedules rs 2`).
On 2 ranks each call of those operators posts once, so the N-th post is the N-th call.

Put this folder first on PYTHONPATH: Python imports `sitecustomize` at start-up in every process (launcher,
torchrun, ranks); it acts only in the process whose RANK is FAULT_RANK. The hook wraps Link.post (every transfer
of ours goes through it, from any thread: a DP ring on its worker thread too) and leaves everything else as it is.
"""
import os

if os.environ.get("FAULT_IN") and os.environ.get("RANK") == os.environ.get("FAULT_RANK", "1"):
    import signal
    import sys

    from megatron_flashoverlap.runtime import transport

    _target, _at, _seen = os.environ["FAULT_IN"], int(os.environ.get("FAULT_CALL", "1")), [0]
    _post = transport.Link.post

    def _inside() -> bool:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_qualname == _target:
                return True
            f = f.f_back
        return False

    def post(self, step, *args):
        if _inside():
            _seen[0] += 1
            if _seen[0] >= _at:
                print(f"fault: rank {os.environ['RANK']} stops itself inside {_target} (post {_seen[0]}, ring "
                      f"step {step})", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
        return _post(self, step, *args)

    transport.Link.post = post
