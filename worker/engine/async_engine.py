"""`AsyncEngine`: an `LLMEngine` behind the `Engine` protocol (worker/engine/types.py);
it is the backend of `--engine radix` (a model) and `--engine sim` (a cost model) alike.

Loading weights takes from seconds (the tiny model) to minutes (a real model), so the
radix backend hands over a loader that `start()` runs off the event loop, after the
app's port is open: meanwhile `/health` answers 503 ("engine is starting") instead of
refusing connections, as Kubernetes startup probes and `radix-router up` expect, and a
request that slips through is refused with `EngineOverloaded` (503).

The step loop runs in its own thread, never on the event loop. The event loop talks to
it through an inbox of commands (add, abort, flush) guarded by a condition variable;
the thread sleeps on that condition while it has nothing to do (no busy spin). Outputs
go back to one `Mailbox` per request, all of a step in one hand-over to the loop; a
stream yields what its mailbox holds merged per choice (worker/engine/mailbox.py),
except for requests that asked for logprobs, which get one output per step.

Threads: `_inbox` is shared under `_cond`; `_boxes` belongs to the engine thread;
`_active` (request ids of open streams, for duplicate and overload checks) to the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from worker.engine.chat import render_chat
from worker.engine.engine import LLMEngine
from worker.engine.kv_blocks import BlockEvents
from worker.engine.mailbox import (
    Delivery,
    Item,
    Mailbox,
    RequestStream,
    coalesce,
    send,
    split,
)
from worker.engine.req import Req
from worker.engine.types import (
    EngineError,
    EngineOverloaded,
    EngineRequest,
    EngineStats,
    GenerateOutput,
)

log = logging.getLogger(__name__)


class AsyncEngine:
    """Drives an engine: a built one, or a loader `start()` calls in a thread (building
    one loads its model: never on the event loop); `start()` launches the step thread."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], model_name: str) -> None:
        self._engine = engine if isinstance(engine, LLMEngine) else None
        self._load = None if isinstance(engine, LLMEngine) else engine
        self.model_name = model_name
        self._cond = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._boxes: dict[str, Mailbox] = {}
        self._active: set[str] = set()

    @property
    def engine(self) -> LLMEngine:
        """The synchronous engine (tests read its integrity while it is idle)."""
        if self._engine is None:
            # The HTTP layer refuses requests before the engine is ready; this is the
            # backstop for anything that slips through (answered 503).
            raise EngineOverloaded("the model is still loading")
        return self._engine

    @property
    def max_model_len(self) -> int:
        return 0 if self._engine is None else self._engine.max_model_len

    # --- lifecycle ---

    async def start(self) -> None:
        if self._engine is None:
            assert self._load is not None
            self._engine = await asyncio.to_thread(self._load)
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is in flight (streams end with finish_reason "abort") and join."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(thread.join)
        self._thread = None

    # --- requests ---

    def generate(self, request: EngineRequest) -> RequestStream:
        """Validates now (EngineError / EngineOverloaded before anything is queued); the
        request is queued when the returned iterator is first awaited."""
        engine = self.engine  # EngineOverloaded while the model loads
        if self._thread is None or self._stopping:
            raise EngineOverloaded("the engine is not running")
        if request.request_id in self._active:
            raise EngineError(
                f"request id {request.request_id!r} is already in flight", param="request_id"
            )
        limit = engine.config.max_running_requests + engine.config.max_waiting_requests
        if len(self._active) >= limit:
            raise EngineOverloaded(f"{len(self._active)} requests in flight; try again later")
        reqs = engine.make_reqs(request)
        assert self._loop is not None
        box, pending = Mailbox(self._loop), deque[Item]()
        return RequestStream(box, pending).start(self._stream(reqs, box, pending))

    async def _stream(
        self, reqs: list[Req], box: Mailbox, pending: deque[Item]
    ) -> AsyncGenerator[GenerateOutput, None]:
        rid = reqs[0].request_id
        merge = not reqs[0].params.needs_logprobs  # logprobs: one output per step
        self._active.add(rid)
        self._submit(lambda: self._do_add(reqs, box))
        done = False
        unfinished = len(reqs)  # choices still generating
        try:
            while True:
                if not pending:
                    outputs, error = split(await box.take())
                    pending.extend(coalesce(outputs) if merge else outputs)
                    if error is not None:
                        pending.append(error)
                item = pending.popleft()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                unfinished -= item.finished
                done = unfinished == 0
                yield item
                if done:
                    return
        finally:
            # Early close (client gone: aclose, GeneratorExit, CancelledError) aborts
            # the request, which frees every slot it held.
            self._active.discard(rid)
            if not done:
                self._submit(lambda: self._do_abort(rid))

    async def abort(self, request_id: str) -> None:
        self._submit(lambda: self._do_abort(request_id))

    async def flush_cache(self) -> bool:
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()

        def flush() -> None:
            try:
                done.set_result(self.engine.flush_cache())
            except Exception as exc:
                done.set_exception(exc)

        self._submit(flush)
        return await asyncio.wrap_future(done)

    async def release_pin(self, key: str) -> bool:
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()

        def release() -> None:
            try:
                done.set_result(self.engine.release_pin(key))
            except Exception as exc:
                done.set_exception(exc)

        self._submit(release)
        return await asyncio.wrap_future(done)

    def stats(self) -> EngineStats:
        if self._engine is None:
            return EngineStats(0, 0, 0, 0, 0, 0, 0)
        return self._engine.stats()

    @property
    def kv_events(self) -> BlockEvents | None:
        return None if self._engine is None else self._engine.kv_events

    def tokenize(self, text: str) -> list[int]:
        return self.engine.encode_prompt(text)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        return self.engine.tokenizer.token_bytes(ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return render_chat(self.engine.tokenizer, messages, add_generation_prompt)

    # --- engine thread ---

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or engine.has_work):
                    self._cond.wait()
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            self._run_commands(commands)
            if stopping:
                break
            try:
                outputs = engine.step()
            except Exception as exc:  # a model failure must not kill the thread silently
                log.exception("engine step failed; failing every request in flight")
                self._fail_all(exc)
                continue
            self._dispatch(outputs)
        self._abort_all()
        # Commands that raced with the stop: resolve flushes, end late streams.
        with self._cond:
            late, self._inbox = self._inbox, []
        self._run_commands(late)
        self._abort_all()

    def _run_commands(self, commands: list[Callable[[], None]]) -> None:
        for command in commands:
            try:
                command()
            except Exception:  # one bad command must not stop the loop for everyone
                log.exception("engine command failed")

    def _do_add(self, reqs: list[Req], box: Mailbox) -> None:
        try:
            self.engine.add(reqs)
        except EngineError as exc:
            self._send([(box, exc)])
            return
        self._boxes[reqs[0].request_id] = box

    def _do_abort(self, request_id: str) -> None:
        outs = self.engine.abort(request_id)
        box = self._boxes.pop(request_id, None)
        if box is not None:
            self._send([(box, out) for out in outs])

    def _abort_all(self) -> None:
        for rid in list(self._boxes):
            self._do_abort(rid)

    def _dispatch(self, outputs: list[GenerateOutput]) -> None:
        boxes = self._boxes
        delivery: Delivery = []
        for out in outputs:
            box = boxes.get(out.request_id)
            if box is not None:
                delivery.append((box, out))
        # After the whole step: several choices of one request may finish in it.
        for out in outputs:
            if out.finished and out.request_id not in self.engine.in_flight:
                boxes.pop(out.request_id, None)
        self._send(delivery)

    def _fail_all(self, exc: Exception) -> None:
        error = RuntimeError(f"engine step failed: {exc!r}")
        delivery: Delivery = []
        for rid in list(self._boxes):
            self.engine.abort(rid)
            delivery.append((self._boxes.pop(rid), error))
        self._send(delivery)

    def _send(self, delivery: list[tuple[Mailbox, Item]]) -> None:
        assert self._loop is not None
        send(self._loop, delivery)
