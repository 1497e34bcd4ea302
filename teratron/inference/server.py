"""An OpenAI-compatible HTTP server on aiohttp: `teratron serve`.

    POST /v1/completions        prompt -> text        (`stream: true`: server-sent events)
    POST /v1/chat/completions   messages -> message   (the model's chat template)
    GET  /v1/models             the served model (its id: the checkpoint folder's name)
    GET  /health                200 while the engine runs, else 503

    app = OpenAIServer(AsyncInferenceEngine(engine), served).build_app()
    asyncio.run(serve(app, "127.0.0.1", 8000))           # until cancelled (Ctrl+C)

Every error is a JSON body `{"error": {"message", "type", "param", "code"}}`: 400 for malformed
JSON or invalid parameters (openai_api), 404 / 405 for unknown routes or methods, 413 for a body
over `client_max_size`; an exception in a handler is a 500 with the same shape and the server goes
on. A streamed response sends `data: {chunk}` events and ends with `data: [DONE]` (an error after
the first event is sent as an event). A client that disconnects cancels its handler
(`handler_cancellation`), which aborts its request and frees its KV-cache blocks.
"""

import asyncio
import contextlib
import json
import logging
import time

from aiohttp import web

from teratron.inference.async_engine import AsyncInferenceEngine
from teratron.inference.openai_api import (GenerationRequest, RequestError, Responses, ServedModel, error_body,
                                           parse_chat, parse_completion)

MAX_REQUEST_BYTES = 4 << 20  # a request body of at most 4 MiB: prompts of a few hundred thousand tokens
# Ctrl+C or SIGTERM: a request in flight may finish for this long; aiohttp then waits as long again
# for its handler after cancelling the request's input, and cancels the handler (about 5 s in all).
SHUTDOWN_TIMEOUT_S = 2.5
_STATUS_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}

logger = logging.getLogger(__name__)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Every failure as OpenAI's error body; an unexpected one logged and answered 500."""
    try:
        return await handler(request)
    except RequestError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
        if e.status < 400:
            raise
        messages = {404: f"no route {request.path}: the server answers /v1/completions, /v1/chat/completions, "
                         "/v1/models and /health",
                    405: f"{request.method} is not allowed on {request.path}",
                    413: f"the request body is larger than this server accepts ({MAX_REQUEST_BYTES} bytes)"}
        kind = _STATUS_TYPES.get(e.status, "invalid_request_error")
        return web.json_response(error_body(messages.get(e.status, e.reason), kind), status=e.status,
                                 headers={k: v for k, v in e.headers.items() if k == "Allow"})
    except Exception as e:  # noqa: BLE001 - no request may bring the server down
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response(error_body(f"internal server error ({type(e).__name__})", "server_error"),
                                 status=500)


async def _json_body(request: web.Request) -> dict:
    raw = await request.read()  # raises 413 past client_max_size
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


async def serve(app: web.Application, host: str, port: int, on_listening=None) -> None:
    """Serve `app` on host:port until cancelled, then shut it down (requests in flight get
    SHUTDOWN_TIMEOUT_S to finish, then are cancelled, which aborts them, by 2 x SHUTDOWN_TIMEOUT_S;
    the engine stops).
    `on_listening(addresses)` is called once the socket listens (port 0: a free port, which the
    addresses show)."""
    # handler_cancellation: a client that disconnects cancels its handler. shutdown_timeout: aiohttp's
    # default, 60 s (twice over), kept a stopped server alive two minutes behind a running request.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:  # taken, not this machine's address, a privileged port
            raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); choose another "
                          "--port or --host") from None
        if on_listening is not None:
            on_listening(runner.addresses)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _sse(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


class OpenAIServer:
    def __init__(self, engine: AsyncInferenceEngine, served: ServedModel):
        self.engine = engine
        self.served = served
        self.created = int(time.time())

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[_json_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start_engine)
        app.on_cleanup.append(self._stop_engine)
        return app

    async def _start_engine(self, app) -> None:
        self.engine.start()

    async def _stop_engine(self, app) -> None:
        await self.engine.stop()

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.served.model_id, "object": "model", "created": self.created, "owned_by": "teratron",
                 "max_model_len": self.served.max_sequence_length}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.is_running:
            return web.json_response({"status": "ok"})
        return web.json_response(error_body("the inference engine is not running", "server_error"), status=503)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, parse_completion(await _json_body(request), self.served))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, parse_chat(await _json_body(request), self.served))

    async def _answer(self, request: web.Request, generation: GenerationRequest) -> web.StreamResponse:
        responses = Responses(generation, self.served)
        outputs = self.engine.generate(generation.prompt_token_ids, generation.params)
        async with contextlib.aclosing(outputs):  # leaving early (an error, a disconnect) aborts the request
            try:
                first = await anext(outputs)
            except ValueError as e:  # the engine refused it: it can never fit
                raise RequestError(str(e)) from None
            if generation.stream:
                return await self._stream(request, responses, first, outputs)
            last = first
            async for last in outputs:
                pass
            return web.json_response(responses.final(last))

    async def _stream(self, request, responses: Responses, first, outputs) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            await self._send_chunks(response, responses, first)
            async for output in outputs:
                await self._send_chunks(response, responses, output)
        except ConnectionResetError:
            return response  # the client has gone: nothing more to send (leaving aborts the request)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it as an event
            logger.exception("%s %s failed while streaming", request.method, request.path)
            await response.write(_sse(error_body(f"internal server error ({type(e).__name__})", "server_error")))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response

    @staticmethod
    async def _send_chunks(response: web.StreamResponse, responses: Responses, output) -> None:
        for chunk in responses.chunks(output):
            await response.write(_sse(chunk))
