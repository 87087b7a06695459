"""The server entry's fault handling without a server: the frontends' watch (megatron/cli/engine_watch.py: a 503
naming why for the requests in flight and later ones, rank 0's death seen through the parent pid and reported to
the launcher) and rank 0's orderly stop (megatron/cli/serve.py `stop_server`: bounded by the engines' step and
then a slack, never by a fixed time; an engine failing meanwhile ends it at once).

Tier 1 (no Megatron process group): a plain ASGI app, Megatron's own Quart app built as its frontend builds it,
two forked processes for rank 0 and its frontend, and a stand-in `llm` whose engine state and shutdown are
scripted. Time bounds are the code's constants made small (monkeypatch), asserted with a scheduling margin.
The same paths on a running server: tests/megatron/test_serve.py. Newest lane only, as the server entry (its
Quart frontend, Megatron's inference config and `megatron.training` are megatron-core 0.19's and the serve extra's).
"""
import asyncio
import json
import multiprocessing as mp
import os
import time
from types import SimpleNamespace

import pytest

from megatron_flashoverlap.megatron.cli import engine_watch, serve
from megatron_flashoverlap.megatron.cli.engine_watch import EngineWatch, Guard

pytestmark = pytest.mark.newest_only

WHY = "the inference engine on rank 1 stopped on an error (RuntimeError: Connection closed by peer)"


class Script:
    """A watch whose answer the test sets."""
    def __init__(self):
        self.seen = None

    def why(self):
        return self.seen


def call(app, path="/v1/completions"):
    """One HTTP request through an ASGI app -> (status, body dict or None)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    return app(scope, receive, send), sent


def answer(sent):
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body) if body else None


async def hanging(scope, receive, send):  # a completion waiting for an engine that no longer answers
    await asyncio.Event().wait()


async def ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b'{"ok": true}'})


def test_a_request_in_flight_and_every_later_one_get_a_503_naming_why(monkeypatch):
    monkeypatch.setattr(engine_watch, "POLL_S", 0.01)

    async def main():
        script = Script()
        guard, quick = Guard(hanging, script), Guard(ok, script)
        poll = asyncio.ensure_future(guard.poll())
        quick_poll = asyncio.ensure_future(quick.poll())
        served, sent_ok = call(quick)
        await served
        assert answer(sent_ok) == (200, {"ok": True})  # answered before: unchanged
        pending, sent = call(guard)
        task = asyncio.ensure_future(pending)
        await asyncio.sleep(0.05)
        assert not task.done() and not sent  # in flight, the engines still serving
        script.seen = (WHY, False)
        await asyncio.wait_for(task, 2)
        later, sent_later = call(guard, "/health")
        await asyncio.wait_for(later, 2)
        await asyncio.wait_for(asyncio.gather(poll, quick_poll), 2)
        return answer(sent), answer(sent_later)
    in_flight, later = asyncio.run(main())
    for status, body in (in_flight, later):
        assert status == 503 and body["error"]["message"] == WHY, (status, body)
        assert body["error"]["type"] == "server_error" and body["error"]["code"] == "engine_unavailable"


def _frontend(watch, out, env):
    """Rank 0's frontend stand-in: polls the watch as a frontend does; -> (why, died, report) on `out`."""
    os.environ.update(env)
    guard = Guard(ok, watch)
    asyncio.run(asyncio.wait_for(guard.poll(), 20))
    reports = os.listdir(env["FLASHOVERLAP_FAILURE_DIR"])
    text = open(os.path.join(env["FLASHOVERLAP_FAILURE_DIR"], reports[0])).read() if reports else ""
    out.put((guard.reason, reports, text))


def _rank0(out, env, dies):
    """Rank 0 stand-in: makes the watch, forks its frontend, then dies (os._exit) or says why."""
    watch = EngineWatch()
    frontend = mp.get_context("fork").Process(target=_frontend, args=(watch, out, env))
    frontend.start()
    time.sleep(0.5)  # the frontend polls a serving watch meanwhile
    if dies:
        os._exit(9)
    watch.stopping(WHY)
    frontend.join(20)


@pytest.mark.parametrize("dies", [True, False], ids=["rank 0 dies", "rank 0 says why"])
def test_a_frontend_sees_rank_0_die_and_reports_it_or_hears_why(tmp_path, dies):
    ctx = mp.get_context("fork")
    out, env = ctx.Queue(), {"FLASHOVERLAP_FAILURE_DIR": str(tmp_path), "RANK": "0"}
    rank0 = ctx.Process(target=_rank0, args=(out, env, dies))
    rank0.start()
    reason, reports, text = out.get(timeout=30)
    rank0.join(10)
    if dies:
        assert f"rank 0 (pid {rank0.pid}) ended" in reason and "inference engine stopped" in reason, reason
        assert reports == ["rank0"] and reason in text, (reports, text)  # what the launcher's watch reads
    else:
        assert reason == WHY and reports == [], (reason, reports)  # rank 0 reports its own failure


def test_install_guards_megatrons_frontend_app(monkeypatch):
    """Megatron's frontend builds its Quart app from `endpoints.__all__`: /health answers 200 until the watch
    fires, then 503 naming why."""
    from megatron.core.inference.text_generation_server.dynamic_text_gen_server import endpoints
    from quart import Quart

    monkeypatch.setattr(endpoints, "__all__", list(endpoints.__all__))
    monkeypatch.setattr(engine_watch, "POLL_S", 0.01)
    watch = EngineWatch()
    watch.pid = os.getppid()  # this process stands in for the frontend: its parent is "rank 0"
    engine_watch.install(watch)
    engine_watch.install(watch)  # again: one guard

    async def main():
        app = Quart("frontend")
        app.config["client"] = object()
        for bp in endpoints.__all__:
            app.register_blueprint(bp)
        assert isinstance(app.asgi_app, Guard) and not isinstance(app.asgi_app.app, Guard)
        async with app.test_app():
            client = app.test_client()
            before = (await client.get("/health")).status_code
            watch.stopping(WHY)
            await asyncio.sleep(0.1)
            after = await client.get("/health")
            return before, after.status_code, await after.get_json()
    before, after, body = asyncio.run(main())
    assert before == 200 and after == 503 and body["error"]["message"] == WHY, (before, after, body)


class Engine:
    """The stand-in engine: its state, its loop task and Megatron's coordinator process handle."""
    def __init__(self):
        self.state = SimpleNamespace(name="RUNNING")
        self.engine_loop_task = None
        self.inference_coordinator_process = SimpleNamespace(is_alive=lambda: True, killed=[])
        self.inference_coordinator_process.kill = lambda: self.inference_coordinator_process.killed.append(1)


class LLM:
    """`shutdown` as scripted: `step` seconds RUNNING, then PAUSED, then done after `rest` (None: never)."""
    def __init__(self, step: float, rest):
        self.engine, self.step, self.rest = Engine(), step, rest

    async def shutdown(self):
        await asyncio.sleep(self.step)
        self.engine.state.name = "PAUSED"
        await (asyncio.sleep(self.rest) if self.rest is not None else asyncio.Event().wait())

    def killed(self):
        return bool(self.engine.inference_coordinator_process.killed)


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(serve, "STOP_SLACK_S", 0.3)
    monkeypatch.setattr(serve, "ENGINE_POLL_S", 0.02)


def stop(llm, step_s):
    t0 = time.monotonic()
    try:
        asyncio.run(serve.stop_server(llm, step_s))
        return time.monotonic() - t0, None
    except SystemExit as err:
        return time.monotonic() - t0, err


def test_a_stop_waits_for_a_step_longer_than_the_slack_within_the_groups_timeout(small):
    """The engines' current step (2.5x the slack here) ends within the process group's timeout: the stop
    completes, nothing killed (a fixed bound shorter than the step killed the coordinator)."""
    llm = LLM(step=0.75, rest=0.1)
    seconds, err = stop(llm, step_s=2.0)
    assert err is None and not llm.killed() and 0.8 <= seconds < 2.0, (seconds, err)


def test_a_stop_held_after_the_step_ends_past_the_slack_kills_the_coordinator_and_names_the_barriers(small):
    llm = LLM(step=0.1, rest=None)  # paused, then Megatron's stop barrier waits for a rank that is gone
    seconds, err = stop(llm, step_s=60.0)
    assert isinstance(err, serve.StopStuck) and llm.killed(), err
    assert 0.4 <= seconds < 2.0, seconds  # 0.1 s step + 0.3 s slack, not the 60 s of a step
    assert "pause and stop barriers wait for every rank" in str(err.code), err.code


def test_a_step_past_the_groups_timeout_ends_the_stop_naming_it(small):
    llm = LLM(step=60.0, rest=0.1)
    seconds, err = stop(llm, step_s=0.5)
    assert isinstance(err, serve.StopStuck) and llm.killed(), err
    assert 0.8 <= seconds < 2.5 and "--distributed-timeout-minutes" in str(err.code), (seconds, err.code)


def test_an_engine_that_fails_during_the_stop_ends_it_at_once(small):
    llm = LLM(step=60.0, rest=None)

    async def failing():
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    loop = asyncio.new_event_loop()
    llm.engine.engine_loop_task = loop.create_task(failing())
    loop.run_until_complete(asyncio.wait([llm.engine.engine_loop_task]))
    seconds, err = stop(llm, step_s=60.0)
    loop.close()
    assert err is not None and not isinstance(err, serve.StopStuck) and llm.killed(), err
    assert seconds < 1.0 and "Connection closed by peer" in str(err.code), (seconds, err.code)


def _failing_after(llm, seconds: float, busy: bool) -> float:
    """`failing_step` on `llm` whose engine (with requests when `busy`) fails `seconds` after the stop signal;
    -> the seconds it waited."""
    llm.engine.has_unfinished_requests = lambda: busy

    async def main():
        async def fail():
            await asyncio.sleep(seconds)
            raise RuntimeError("Connection reset by peer")
        llm.engine.engine_loop_task = asyncio.ensure_future(fail())
        t0 = time.monotonic()
        await serve.failing_step(llm)
        waited = time.monotonic() - t0
        await asyncio.wait([llm.engine.engine_loop_task])
        return waited
    return asyncio.run(main())


def test_a_stop_signal_while_requests_run_waits_for_the_engine_to_fail_so_the_503_names_it(monkeypatch):
    """torchrun SIGTERMs rank 0 when it sees a peer die, which can come before the engine's collective reports the
    lost peer (CI: the request got "the server is stopping"); with requests running, the engine's failure is
    awaited a bounded time first, so it is what the 503 says. An idle engine, or one that does not fail, is not."""
    monkeypatch.setattr(serve, "STOP_CAUSE_S", 1.0)
    busy = LLM(step=0.0, rest=0.0)
    assert 0.2 <= _failing_after(busy, 0.2, busy=True) < 0.6  # the failure came, then the stop goes on
    assert serve.engine_failure(busy).startswith("RuntimeError: Connection reset by peer")
    assert _failing_after(LLM(step=0.0, rest=0.0), 0.2, busy=False) < 0.1  # idle: no step can fail
    assert 1.0 <= _failing_after(LLM(step=0.0, rest=0.0), 1.6, busy=True) < 1.5  # bounded: STOP_CAUSE_S


def test_torchruns_grace_outlasts_the_longest_orderly_stop(monkeypatch):
    """Under the launcher torchrun waits past the stop's bound (Megatron's group timeout, its default read from
    Megatron) before its SIGKILL; a grace the user set stays."""
    import dataclasses

    from megatron.training.config import DistributedInitConfig

    default = next(f.default for f in dataclasses.fields(DistributedInitConfig)
                   if f.name == "distributed_timeout_minutes")
    longest = 2 * serve.STOP_SLACK_S + serve.EXIT_SLACK_S
    assert serve.torchrun_grace_s(["--cpu"]) == 60 * default + longest
    assert serve.torchrun_grace_s(["--distributed-timeout-minutes", "1"]) == 60 + longest
    seen = []
    monkeypatch.setattr(serve.launch, "run_entry", lambda *a: seen.append(os.environ.get(serve.TORCHRUN_GRACE_ENV)))
    monkeypatch.delenv(serve.TORCHRUN_GRACE_ENV, raising=False)
    serve.main(["--cpu", "--distributed-timeout-minutes", "1"])  # a rank: torchrun already runs
    serve.main(["--nproc-per-node", "2", "--distributed-timeout-minutes", "1"])
    monkeypatch.setenv(serve.TORCHRUN_GRACE_ENV, "45")
    serve.main(["--nproc-per-node", "2"])
    assert seen == [None, str(60 + int(longest)), "45"], seen


def test_serving_refreshes_the_engine_consensus_every_loop_with_one_expert_rank():
    from megatron.core.inference.config import InferenceConfig

    assert InferenceConfig.ep_consensus_interval > 1  # Megatron's default, which held a drained engine busy
    one = serve.serving_config(SimpleNamespace(ep_consensus_interval=20), SimpleNamespace(expert_model_parallel_size=1))
    two = serve.serving_config(SimpleNamespace(ep_consensus_interval=20), SimpleNamespace(expert_model_parallel_size=2))
    assert one.ep_consensus_interval == 1 and two.ep_consensus_interval == 20


# the launcher's orphan rule (launch.torchrun), with a stand-in for torchrun: its rank leaves two children and
# exits 0; one child ends by itself before the launcher's next poll, the other (a frontend) would run on
RANK_LEAVING = ("import subprocess, sys\n"
                "quick = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.45)'])\n"
                "frontend = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                "print(quick.pid, frontend.pid, flush=True)\n")
TORCHRUN = f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {RANK_LEAVING!r}])\ntime.sleep(3)\n"
LAUNCHER = ("import subprocess, sys\n"
            "from megatron_flashoverlap.megatron.cli import launch\n"
            "real = subprocess.Popen\n"
            f"subprocess.Popen = lambda cmd, env: real([sys.executable, '-c', {TORCHRUN!r}], env=env)\n"
            "sys.exit(launch.torchrun('stand.in', False, 1, []))\n")


def test_the_launcher_kills_what_a_rank_leaves_at_its_second_sighting_and_leaves_the_job_to_torchrun():
    """A process a rank left is killed one poll after it is first seen (a dead rank 0's frontend answers its
    requests meanwhile); one that ends by itself before (a child a rank leaves as it exits in order) is not
    named; torchrun, not the launcher, ends the job: its exit code (0 here) is the launcher's. In its own
    process: the launcher becomes a subreaper."""
    import subprocess
    import sys

    import psutil

    run = subprocess.run([sys.executable, "-c", LAUNCHER], capture_output=True, text=True, timeout=60)
    quick, frontend = map(int, run.stdout.split())
    lines = [line for line in run.stderr.splitlines() if "leaving processes" in line]
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert lines == [f"flashoverlap-launch: a rank ended leaving processes [{frontend}]: killing them"], lines
    assert not psutil.pid_exists(frontend) and not psutil.pid_exists(quick)
