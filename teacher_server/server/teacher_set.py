"""The teachers of one service and the choice among them by a request's ``model``.

Each teacher is a state holder with what the routes read of an engine: ``cfg``, ``engine``,
``aengine``, ``limits``, ``status``, ``metrics``, and its tokenizer once read. With one teacher
the app's own state is that holder (everything reads as before); with several, each has its
own, and the app's ``aengine`` is a ``TeacherSetEngine`` over all of them once all are ready,
so the drain, the shutdown and the readiness check see the whole service."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor
from typing import Any

import orjson
from starlette.datastructures import State

from teacher_server.config import Config
from teacher_server.server.admission import QueueWait
from teacher_server.server.completion_request import refused_call_id
from teacher_server.server.metrics import Metrics
from teacher_server.server.parsing import body_request_id, refuse_long_prompt
from teacher_server.server.sglang_generate import refused_call_id as sglang_refused_call_id
from teacher_server.validation import BadRequest

PEEK_INLINE_BYTES = 256 * 1024  # larger bodies are read for their `model` off the event loop


class Teachers:
    """The teachers by name (each served name and alias), in the configuration's order."""

    def __init__(self, app_state: State, cfgs: list[Config], metrics: Metrics) -> None:
        if len(cfgs) == 1:
            app_state.cfg = cfgs[0]
            self.all: list[State] = [app_state]
        else:
            self.all = []
            for i, c in enumerate(cfgs):
                t = State()
                t.cfg, t.status, t.engine, t.aengine, t.loop = c, "loading", None, None, app_state.loop
                # a teacher's estimated wait: its own queue over its own measured throughput
                t.queue_wait = app_state.queue_wait if i == 0 else QueueWait(c.max_queue_wait_s)
                # one registry: the first teacher's series are the app's own (the front's gauges too)
                t.metrics = metrics if i == 0 else metrics.for_model(c.served_name, c.data_parallel_size)
                self.all.append(t)
        self._by_name = {n: t for t in self.all for n in t.cfg.served_names}

    @property
    def single(self) -> State | None:
        """The one teacher; None when there are several (the request's ``model`` says which)."""
        return self.all[0] if len(self.all) == 1 else None

    @property
    def names(self) -> list[str]:
        return [t.cfg.served_name for t in self.all]

    def named(self, model: object) -> State:
        """The teacher a request names; 404 for a name no teacher has (in each endpoint's
        error shape, as for one teacher), 400 without one."""
        if isinstance(model, str) and model in self._by_name:
            return self._by_name[model]
        served = ", ".join(self.names)
        if model is None:
            raise BadRequest(f"`model` is required: this server serves several teachers ({served})", "model")
        if not isinstance(model, str):
            raise BadRequest("`model` must be a string", "model")
        raise BadRequest(f"The model `{model[:200]}` does not exist; this server serves {served}.", "model",
                         status=404)

    async def pick(self, raw: bytes, pool: Executor, endpoint: str = "generate",
                   header_request_id: str | None = None) -> tuple[State, dict | None]:
        """The teacher of a request body (JSON) by its ``model``, and the body's JSON object,
        parsed here once: the teacher's endpoint validates it without parsing the bytes again.
        A body that is no JSON object goes to the first teacher (with None), whose parser
        answers it with the usual 400. A prompt longer than every teacher takes is refused from
        the bytes first, as with one teacher (``refuse_long_prompt``; not while one is loading)."""
        lens = [getattr(t, "limits", None) for t in self.all]
        most = max(x.max_model_len for x in lens) if all(x is not None for x in lens) else None
        loop, obj = asyncio.get_running_loop(), None
        try:  # (a large body's byte check and parse off the event loop)
            obj = await loop.run_in_executor(pool, _peek, raw, endpoint, most) if len(raw) > PEEK_INLINE_BYTES \
                else _peek(raw, endpoint, most)
            if obj is None:
                return self.all[0], None
            return self.named(obj.get("model")), obj
        except BadRequest as e:  # (named as the endpoint names a refused call with one teacher)
            e.request_id = _call_id(obj, endpoint, header_request_id)
            raise


def _peek(raw: bytes, endpoint: str, most: int | None) -> dict | None:
    """``body_object``, after ``refuse_long_prompt`` against the longest prompt a teacher takes
    (None: a teacher is still loading, its length unknown)."""
    if most is not None:
        refuse_long_prompt(raw, endpoint, most)
    return body_object(raw)


def _call_id(obj: dict | None, endpoint: str, header_request_id: str | None) -> str | None:
    """The id an endpoint's refusal is logged by, as each endpoint's own parse names it (``obj``:
    None where the body was refused unparsed)."""
    if endpoint == "completions":
        return refused_call_id(obj, header_request_id)
    if obj is None:
        return None
    return sglang_refused_call_id(obj) if endpoint == "sglang-generate" else body_request_id(obj)


def body_object(raw: bytes) -> dict | None:
    """The body's JSON object; None when it is not valid JSON or not an object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


class TeacherSetEngine:
    """The service's engine surface over every teacher's (``app.state.aengine`` with several):
    what the drain, the shutdown and the readiness check ask of it."""

    def __init__(self, teachers: list[State]) -> None:
        self.teachers = teachers

    @property
    def _engines(self) -> list[Any]:
        return [t.aengine for t in self.teachers]

    @property
    def alive(self) -> bool:
        """Some teacher can serve: requests are read and sent to the teacher they name, which
        answers 503 itself when it cannot (``/health`` tells teacher by teacher)."""
        return any(e.alive for e in self._engines)

    @property
    def accepting(self) -> bool:
        return all(e.accepting for e in self._engines)

    @property
    def capacity(self) -> tuple[int, int]:
        """(serving, total) over all teachers' replicas."""
        caps = [e.capacity for e in self._engines]
        return sum(c[0] for c in caps), sum(c[1] for c in caps)

    @property
    def fatal_error(self) -> str | None:
        errs = [f"{t.cfg.served_name}: {t.aengine.fatal_error}" for t in self.teachers if t.aengine.fatal_error]
        return "; ".join(errs) or None

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self._engines)

    def stop_accepting(self) -> None:
        for e in self._engines:
            e.stop_accepting()

    async def drain(self, timeout: float) -> bool:
        done = await asyncio.gather(*(e.drain(timeout) for e in self._engines))
        return all(d is not False for d in done)

    def shutdown(self) -> None:
        all_at_once([e.shutdown for e in self._engines])


def all_at_once(calls: list[Any]) -> None:
    """Each call on a thread of its own, waited for together: the teachers' teardowns overlap,
    so a shutdown takes the slowest one's time, not their sum (a hung engine's is ~30 s, and the
    chart's exit margin is sized for one); the first error is raised after all have ended."""
    errors: list[BaseException] = []

    def run(call: Any) -> None:
        try:
            call()
        except BaseException as e:  # (raised below, once every teardown has ended)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,), name="teacher-shutdown", daemon=True) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class TeacherPools:
    """``app.state.replica_pool`` with several teachers: the shutdown of those still starting."""

    def __init__(self, teachers: list[State]) -> None:
        self.teachers = teachers

    def shutdown(self) -> None:
        all_at_once([p.shutdown for p in (getattr(t, "replica_pool", None) for t in self.teachers) if p is not None])


def teacher_health(t: State) -> dict:
    """One teacher's line of ``/health``: its status and replicas serving."""
    ae = t.aengine
    if ae is None:
        return {"status": t.status, "replicas_serving": 0, "replicas": t.cfg.data_parallel_size,
                "message": "engine is loading" if t.status == "loading" else "engine failed to start"}
    serving, total = ae.capacity
    status = "failed" if not ae.alive or serving == 0 else "draining" if not ae.accepting \
        else "ready" if serving == total else "degraded"
    out = {"status": status, "replicas_serving": serving, "replicas": total}
    if status != "ready" and ae.fatal_error:
        out["message"] = ae.fatal_error
    return out
