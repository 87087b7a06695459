"""The HTTP frontends' watch on the engine side (serve.py): once rank 0's engines no longer serve, every request in
flight and every later one (`/health` too) gets a 503 naming why, instead of a closed connection or a hang.

    watch = EngineWatch()     rank 0, before Megatron forks its frontends (its Quart app, one process per replica)
    install(watch)            every frontend's app runs behind `Guard`, which polls the watch every POLL_S
    watch.stopping(why)       rank 0: its engine failed, or its orderly stop began: the frontends answer 503 `why`

What a frontend sees:
    rank 0 said why (`stopping`)        503 {"error": {"message": why, "type": "server_error", "code": ...}}
    its parent is no longer rank 0      rank 0 died (kill -9, the OOM killer): 503 "... rank 0 (pid N) ended ...";
                                        the launcher's failure watch (failures.py) is told, since rank 0 cannot
`Guard` (an ASGI middleware around the app's `asgi_app`) races each HTTP request against that moment: a request
answered first passes unchanged; otherwise it is cancelled and answered 503 (where its response had not started).
The launcher (launch.py) kills a dead rank's frontends one poll after it first sees them, after this answer.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
from multiprocessing import sharedctypes

POLL_S = 0.1  # how often a frontend looks at the watch
WHY_BYTES = 2048  # the longest reason rank 0 can hand its frontends
NAME = "flashoverlap_engine_watch"


class EngineWatch:
    """Rank 0's pid and the reason it gives, in memory its frontends share (they fork from rank 0 after this)."""

    def __init__(self):
        self.pid = os.getpid()
        self._why = sharedctypes.RawArray("c", WHY_BYTES)
        self._said = sharedctypes.RawValue("i", 0)

    def stopping(self, why: str) -> None:
        """Rank 0: the engines no longer serve, because `why` (the first reason stays)."""
        if not self._said.value:
            self._why.value = why.encode()[:WHY_BYTES - 1]
            self._said.value = 1  # after the text: a frontend reads a whole reason

    def why(self) -> tuple[str, bool] | None:
        """A frontend: (why the engines no longer serve, whether rank 0 died) or None while they serve."""
        if self._said.value:
            return self._why.value.decode(errors="replace"), False
        if os.getppid() != self.pid:
            return f"the inference engine stopped: rank 0 (pid {self.pid}) ended; the server is shutting down", True
        return None


class Guard:
    """ASGI middleware: `app`'s HTTP requests race the watch; once it fires, 503 naming why (module docstring)."""

    def __init__(self, app, watch: EngineWatch):
        self.app, self.watch, self.reason = app, watch, None
        self._fired: asyncio.Event | None = None
        self.task: asyncio.Task | None = None  # `poll`, started with the app

    def _event(self) -> asyncio.Event:
        if self._fired is None:  # made on the frontend's loop
            self._fired = asyncio.Event()
        return self._fired

    async def poll(self) -> None:
        """The frontend's task: until the watch fires; rank 0's death is reported to the launcher."""
        while (seen := self.watch.why()) is None:
            await asyncio.sleep(POLL_S)
        self.reason, died = seen
        self._event().set()
        if died:
            _tell_launcher(self.reason)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.reason is None:
            started = []

            async def sending(message):
                started.append(message["type"] == "http.response.start")
                await send(message)
            served, fired = asyncio.ensure_future(self.app(scope, receive, sending)), \
                asyncio.ensure_future(self._event().wait())
            await asyncio.wait({served, fired}, return_when=asyncio.FIRST_COMPLETED)
            fired.cancel()
            if served.done():
                return served.result()
            served.cancel()
            await asyncio.wait({served})
            if any(started):
                return
        await refuse(send, self.reason)


async def refuse(send, why: str) -> None:
    """503 with OpenAI's error body."""
    body = json.dumps({"error": {"message": why, "type": "server_error", "param": None,
                                 "code": "engine_unavailable"}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _tell_launcher(why: str) -> None:
    """Report rank 0's death as its failure (failures.py: the launcher then kills the ranks left after its grace);
    nothing without a launcher."""
    from .failures import reporting

    with contextlib.suppress(SystemExit), reporting():
        raise SystemExit(why)


def install(watch: EngineWatch) -> None:
    """Megatron's frontend app (built from its `endpoints.__all__` in each frontend process) gets `Guard` around
    its `asgi_app` and the watch's poll task at start-up: a blueprint of ours (replacing an earlier one)."""
    from megatron.core.inference.text_generation_server.dynamic_text_gen_server import endpoints
    from quart import Blueprint

    bp = Blueprint(NAME, __name__)

    def guarded(state) -> None:
        app = state.app
        guard = app.asgi_app = Guard(app.asgi_app, watch)

        @app.before_serving
        async def _watch():
            guard.task = asyncio.get_running_loop().create_task(guard.poll())

    bp.record_once(guarded)
    endpoints.__all__[:] = [b for b in endpoints.__all__ if getattr(b, "name", "") != NAME] + [bp]
