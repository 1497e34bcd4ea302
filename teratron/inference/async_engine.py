"""The engine behind an asyncio server: a DynamicInferenceEngine stepped on a thread of its own.

    async_engine = AsyncInferenceEngine(engine)
    async_engine.start()                                   # inside the running event loop
    async with contextlib.aclosing(async_engine.generate(prompt_ids, params)) as outputs:
        async for output in outputs:                       # one RequestOutput per step that
            send(output.new_text)                          # gave the request tokens
    await async_engine.stop()

One thread owns the engine: it adds and aborts requests and runs `engine.step()` while any request
is unfinished, and sleeps otherwise. The event loop never waits for a step, so while the device
runs step n the server keeps parsing, tokenizing and answering requests for step n + 1. Requests
and aborts reach the thread through a queue; its outputs come back to each request's asyncio
queue through the loop.

A caller that stops listening (a client that disconnects cancels its handler; an early
`aclose`) aborts its request, which frees its KV-cache blocks. A step that raises fails the
requests in flight (they get EngineStepError) and the engine thread goes on with new ones; only
if aborting them fails too does it stop, and then `error` says why.
"""

import asyncio
import concurrent.futures
import queue
import threading
from dataclasses import dataclass


class EngineStoppedError(RuntimeError):
    """The engine thread is not running (not started, stopped, or stopped by an error)."""


class EngineStepError(RuntimeError):
    """A step of the engine raised; the requests in it failed (the cause is chained)."""


@dataclass
class _Add:
    prompt_token_ids: list
    params: object
    outputs: asyncio.Queue
    added: concurrent.futures.Future  # -> the request id, or add_request's exception


@dataclass
class _Abort:
    request_id: int


_STOP = object()


class AsyncInferenceEngine:
    def __init__(self, engine):
        self.engine = engine
        self.error = None  # what stopped the engine thread, if it failed
        self._commands = queue.SimpleQueue()
        self._outputs = {}  # request id -> its asyncio queue (the engine thread's)
        self._loop = None
        self._thread = None

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        """Start the engine thread; call it from the event loop that will call `generate`."""
        if self._thread is not None:
            raise RuntimeError("AsyncInferenceEngine.start: already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="teratron-inference-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the engine thread; requests still in flight get EngineStoppedError."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_requests(self) -> int:
        """Requests added and not yet finished or aborted."""
        return len(self._outputs)

    async def generate(self, prompt_token_ids: list, params):
        """The request's RequestOutputs as the engine makes them, the last one `finished`.
        add_request's ValueError (a request that can never fit) is raised here."""
        if not self.is_running:
            raise EngineStoppedError(f"the inference engine is not running{self._why()}")
        outputs, added = asyncio.Queue(), concurrent.futures.Future()
        self._commands.put(_Add(list(prompt_token_ids), params, outputs, added))
        try:
            request_id = await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # the caller left before the engine thread took it
            added.add_done_callback(self._abort_if_added)
            raise
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    def _abort_if_added(self, added: concurrent.futures.Future) -> None:
        if not added.cancelled() and added.exception() is None:
            self._commands.put(_Abort(added.result()))

    def _why(self) -> str:
        return f" (it stopped: {type(self.error).__name__}: {self.error})" if self.error is not None else ""

    # ------------------------------------------------------------------ engine-thread side

    def _run(self) -> None:
        try:
            while self._apply_commands(wait=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - the server must learn why its engine stopped
            self.error = e
        finally:
            self._fail_all(EngineStoppedError(f"the inference engine stopped{self._why()}"))

    def _apply_commands(self, wait: bool) -> bool:
        """Add and abort what the event loop asked for (waiting for a first command when the
        engine is idle); False once asked to stop."""
        try:
            command = self._commands.get() if wait else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif command.request_id in self._outputs:  # not finished meanwhile
                del self._outputs[command.request_id]
                self.engine.abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        if not command.added.set_running_or_notify_cancel():
            return  # the caller left while it was queued
        try:
            request_id = self.engine.add_request(command.prompt_token_ids, command.params)
        except Exception as e:  # noqa: BLE001 - it is the caller's to raise (ValueError: never fits)
            command.added.set_exception(e)
            return
        self._outputs[request_id] = command.outputs
        command.added.set_result(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving new ones
            failed = list(self._outputs)
            error = EngineStepError(f"an inference engine step failed ({type(e).__name__}: {e})")
            error.__cause__ = e
            self._fail_all(error)
            for request_id in failed:
                self.engine.abort(request_id)
            return
        for output in outputs:
            outputs_queue = self._outputs.get(output.request_id)
            if outputs_queue is None:
                continue  # aborted: its caller has gone
            if output.finished:
                del self._outputs[output.request_id]
            self._deliver(outputs_queue, output)

    def _fail_all(self, error: BaseException) -> None:
        for outputs_queue in self._outputs.values():
            self._deliver(outputs_queue, error)
        self._outputs.clear()

    def _deliver(self, outputs_queue: asyncio.Queue, item) -> None:
        try:
            self._loop.call_soon_threadsafe(outputs_queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass
