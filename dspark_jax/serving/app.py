"""The OpenAI-compatible HTTP app (FastAPI): `/v1/chat/completions`, `/v1/completions` (SSE
streaming and not), `/v1/models`, `/health`, `/debug/mtp_stats` (ATOM's schema, docs/architecture.md §5.5,
cumulative since start), `/metrics` (Prometheus text).

Handlers read the body, parse, validate and tokenize it on a worker thread (the chat template
and tokenizing megabytes of text would stall every stream on the event loop), then hand a
`Request` to the `EngineWorker` (the model's one thread) and await its `Update`s. A client that
goes away (stream closed, or a non-streaming request's disconnect) aborts its request, which
frees its slot before the next step; so does `request_timeout`. The API key is compared in
constant time and guards `/v1`, and `/metrics` and `/debug/mtp_stats` unless `metrics_auth` is
off; a request body over `max_request_bytes` is answered 413 without being read whole. Host,
Origin and CORS: `dspark_jax.serving.guard`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from dspark_jax.decode.requests import output_text, stop_checker
from dspark_jax.decode.scheduler import Request
from dspark_jax.errors import RequestError
from dspark_jax.serving.guard import Guard
from dspark_jax.serving.metrics import Metrics
from dspark_jax.serving.protocol import ApiError, Limits, ParsedRequest, parse_chat, parse_completion
from dspark_jax.serving.worker import EngineStopped, EngineWorker, Handle, QueueFull, Update

log = logging.getLogger("dspark_jax.serving")

# Request bodies above this many bytes get HTTP 413 (`--max_request_bytes`). 8 MiB holds a
# 1M-token prompt sent as token ids (about 8 bytes an id in JSON) or several MB of chat text.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass
class ServerConfig:
    model_names: list[str]           # the first is the canonical id in responses to requests without `model`
    max_model_len: int
    num_speculative_tokens: int
    vocab_size: int
    eos_ids: frozenset[int]
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    allow_special_tokens: bool = False     # special-token text in completion prompts -> control tokens
    request_timeout: float | None = None   # seconds from submit to the last token; past it: 504
    metrics_auth: bool = True              # the API key also guards /metrics and /debug/mtp_stats
    allowed_hosts: tuple[str, ...] | None = None   # Host header names accepted (None: any)
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed (CORS); "*": any
    body_timeout: float = 60.0             # seconds to receive a request body; past it: 408
    step_hang_timeout: float | None = 600.0  # /health answers 503 while one step has run longer


class TextStream:
    """Incremental detokenization for streaming. Each update decodes a short window, the new
    tokens after the previous update's (their context: BPE merges, multi-byte characters and a
    decoder's treatment of a leading space span tokens), and takes what the window adds to the
    previous update's text, so a long stream costs linear, not quadratic, decoding. An incomplete
    UTF-8 sequence waits for its next token; a tail that might start a stop string is held back;
    stop strings are searched in the new text only. The final update sends what the whole
    output's text (`output_text`, decoded once) has beyond what was sent, so the concatenated
    deltas equal a non-streaming response's text."""

    def __init__(self, tokenizer, eos_ids: frozenset[int], stops: list[str]):
        self.tokenizer, self.eos_ids, self.stops = tokenizer, eos_ids, stops
        self.tokens: list[int] = []
        self.prefix = self.read = 0        # tokens[prefix:read]: the window's context
        self.text = ""                     # the text of tokens[:read], cut at a stop string
        self.sent = 0                      # characters of `text` sent
        self.stopped = False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, tokens: list[int], final: bool) -> str:
        self.tokens += [t for t in tokens if t not in self.eos_ids]
        if final:
            sent = self.text[:self.sent]
            text = output_text(self.tokens, self.tokenizer, frozenset(), self.stops)
            self.text, self.sent = text, len(text)
            return text[len(sent):] if text.startswith(sent) else ""
        if self.stopped:
            return ""
        context = self.tokenizer.decode(self.tokens[self.prefix:self.read])
        window = self.tokenizer.decode(self.tokens[self.prefix:])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return ""                      # nothing new yet, or a character still incomplete
        seen = len(self.text)
        self.text += window[len(context):]
        self.prefix, self.read = self.read, len(self.tokens)
        found = [i for s in self.stops if (i := self.text.find(s, max(seen - self.hold, 0))) >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
        end = len(self.text) if self.stopped else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:end], end
        return delta


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value (JSON numbers are finite)")


def parse_json(raw: bytes):
    """A request body as JSON, or a 400 saying why not: invalid UTF-8 (decoded strictly here:
    `json.loads` of bytes would let the bytes of a lone surrogate through), NaN / Infinity, an
    integer of more digits than Python converts, nesting deeper than the parser recurses."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"malformed JSON body: not valid UTF-8 at byte {e.start} ({e.reason})") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None
    except ValueError as e:           # JSONDecodeError, NaN, an integer past Python's digit limit
        raise ApiError(400, f"malformed JSON body: {e}") from None


def _metrics(worker: EngineWorker) -> Metrics:
    m = Metrics()
    m.counter("http_requests", "HTTP requests by path and status code.")
    m.counter("requests_finished", "Requests finished, by finish reason (stop, length, abort).")
    m.counter("prompt_tokens", "Prompt tokens of finished requests.")
    m.counter("generation_tokens", "Generated tokens of finished requests.")
    m.histogram("e2e_request_latency_seconds", "Submit to last token.")
    m.histogram("time_to_first_token_seconds", "Submit to first token.")
    m.gauge("num_requests_running", "Requests holding a cache slot.", lambda: worker.num_running)
    m.gauge("num_requests_waiting", "Requests waiting for a slot.", lambda: worker.num_waiting)
    m.gauge("engine_steps", "Propose/verify steps run by the engine.", lambda: worker.num_steps, kind="counter")
    stat = lambda key: (lambda: worker.stats()[key])   # noqa: E731 - a reader per statistic
    m.gauge("spec_decode_num_draft_tokens", "Draft tokens scored (T per verify step).",
            stat("total_draft_tokens"), kind="counter")
    m.gauge("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stat("total_accepted_tokens"),
            kind="counter")
    m.gauge("spec_decode_num_verify_steps", "Per-request verify steps.", stat("num_verify_steps"), kind="counter")
    m.gauge("spec_decode_acceptance_rate", "Accepted / draft tokens.", stat("acceptance_rate"))
    m.gauge("spec_decode_tokens_per_forward", "Mean tokens emitted per verify step (acceptance length).",
            stat("average_tokens_per_forward"))
    m.gauge("spec_decode_per_position_acceptance", "P(draft k accepted), by draft position k = 1..T.",
            lambda: {(("position", str(k + 1)),): a
                     for k, a in enumerate(worker.stats()["per_position_acceptance"])})
    m.gauge("spec_decode_length_steps", "Per-request steps by the speculation length L chosen (drafts "
            "verified; 0 = a one-token step).",
            lambda: {(("length", k),): c for k, c in worker.stats()["verify_length_counts"].items()}, kind="counter")
    return m


def create_app(worker: EngineWorker, tokenizer, cfg: ServerConfig, *, on_startup: Callable[[], None] | None = None,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The app over a started (or to-be-started by `on_startup`) worker."""
    metrics = _metrics(worker)
    limits = Limits(cfg.model_names, cfg.max_model_len, cfg.num_speculative_tokens + 1, cfg.vocab_size,
                    cfg.allow_special_tokens)

    def finished(handle: Handle, update: Update) -> None:        # engine thread
        req = handle.request
        metrics.inc("requests_finished", finish_reason=update.finish_reason or "error")
        metrics.inc("prompt_tokens", len(req.prompt))
        metrics.inc("generation_tokens", len(req.tokens))
        metrics.observe("e2e_request_latency_seconds", time.monotonic() - handle.submitted)

    def first_token(handle: Handle) -> None:                      # engine thread
        metrics.observe("time_to_first_token_seconds", time.monotonic() - handle.submitted)

    worker.on_finish, worker.on_first_token = finished, first_token

    @asynccontextmanager
    async def lifespan(_app):
        if on_startup is not None:
            on_startup()
        yield
        if on_shutdown is not None:
            on_shutdown()

    # no /docs, /redoc, /openapi.json: they would be open whatever the API key
    app = FastAPI(title="dspark-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):     # a bug, still answered in OpenAI's shape (and logged)
        err = ApiError(500, f"internal server error: {type(e).__name__}", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    known_paths = {"/health", "/v1/models", "/debug/mtp_stats", "/metrics", "/v1/chat/completions",
                   "/v1/completions"}

    def count(path: str, status: int) -> None:
        metrics.inc("http_requests", path=path if path in known_paths else "other",   # bounded label set
                    status=str(status))

    app.add_middleware(Guard, count=count, allowed_hosts=cfg.allowed_hosts, allowed_origins=cfg.allowed_origins)

    # the expected header as bytes; starlette decodes header values as latin-1, so encoding the
    # received value back to latin-1 gives the bytes the client sent (a non-ASCII key compares too)
    expected_auth = None if cfg.api_key is None else b"Bearer " + cfg.api_key.encode("utf-8")

    def authorize(request: HttpRequest) -> None:
        if expected_auth is None:
            return
        got = request.headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(got, expected_auth):       # constant time: no timing oracle on the key
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           kind="authentication_error", code="invalid_api_key")

    def too_large() -> ApiError:
        return ApiError(413, f"request body exceeds max_request_bytes={cfg.max_request_bytes} bytes "
                        "(the server's --max_request_bytes)", kind="invalid_request_error",
                        code="request_too_large")

    async def read_body(request: HttpRequest) -> bytes:
        """The body, at most `cfg.max_request_bytes` of it: a larger declared Content-Length is
        refused before anything is read, and a body without one (chunked) is counted chunk by chunk
        and refused as soon as it passes the limit, so an oversized body is never held in memory."""
        limit = cfg.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise ApiError(400, f"invalid Content-Length header: {declared!r}") from None
            if size > limit:
                raise too_large()
        chunks, size = [], 0
        try:
            async with asyncio.timeout(cfg.body_timeout):    # a client trickling its body holds no handler for ever
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large()
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {cfg.body_timeout} s",
                           code="body_timeout") from None
        return b"".join(chunks)

    @app.get("/health")
    async def health():
        if not worker.is_alive():
            error = None if worker.error is None else f"{type(worker.error).__name__}: {worker.error}"
            return JSONResponse({"status": "engine stopped", "error": error}, status_code=503)
        running = worker.step_running_for()
        if cfg.step_hang_timeout is not None and running > cfg.step_hang_timeout:
            return JSONResponse({"status": "engine step hung", "error": f"one engine step has run {running:.0f} s "
                                 f"(more than --step_hang_timeout={cfg.step_hang_timeout} s)"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        authorize(request)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "dspark-jax",
             "max_model_len": cfg.max_model_len} for name in cfg.model_names]}

    @app.get("/debug/mtp_stats")
    async def mtp_stats(request: HttpRequest):
        if cfg.metrics_auth:
            authorize(request)
        return worker.stats()

    @app.get("/metrics")
    async def prometheus(request: HttpRequest):
        if cfg.metrics_auth:
            authorize(request)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        authorize(request)
        raw = await read_body(request)
        return await generate(request, await run_in_threadpool(lambda: parse_chat(parse_json(raw), tokenizer, limits)))

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        authorize(request)
        raw = await read_body(request)
        return await generate(request, await run_in_threadpool(
            lambda: parse_completion(parse_json(raw), tokenizer, limits)))

    async def generate(request: HttpRequest, p: ParsedRequest) -> Response:
        req = Request(p.prompt_ids, p.max_tokens, p.sampling, cfg.eos_ids,
                      stop_checker(p.stop, tokenizer))
        try:
            handle = worker.submit(req, asyncio.get_running_loop())
        except QueueFull as e:
            raise ApiError(503, str(e), kind="server_overloaded", code="queue_full") from None
        except EngineStopped as e:
            raise ApiError(503, str(e), kind="server_error", code="engine_stopped") from None
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        rid = ("chatcmpl-" if p.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        if p.stream:
            # the stream's own `finally` aborts when the client leaves mid-stream; the background
            # task also covers a client gone before the stream's first chunk (a no-op once finished)
            return StreamingResponse(_stream(handle, p, rid), media_type="text/event-stream",
                                     background=BackgroundTask(worker.abort, handle))
        return await _complete(request, handle, p, rid)

    def _usage(p: ParsedRequest, n: int) -> dict:
        return {"prompt_tokens": len(p.prompt_ids), "completion_tokens": n,
                "total_tokens": len(p.prompt_ids) + n}

    def timed_out() -> ApiError:
        return ApiError(504, f"the request did not finish within request_timeout={cfg.request_timeout} s "
                        "(the server's --request_timeout)", kind="timeout", code="request_timeout")

    def time_left(handle: Handle) -> float | None:
        return None if cfg.request_timeout is None else handle.submitted + cfg.request_timeout - time.monotonic()

    async def disconnected(request: HttpRequest) -> None:
        """Returns when the client has gone (the body is read: the next message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _complete(request: HttpRequest, handle: Handle, p: ParsedRequest, rid: str) -> Response:
        tokens: list[int] = []
        gone = asyncio.ensure_future(disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(handle.updates.get())
                done, _ = await asyncio.wait((get, gone), timeout=time_left(handle),
                                             return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    worker.abort(handle)              # freed before the engine's next step
                    if gone in done:
                        return Response(status_code=499)      # nobody is listening
                    raise timed_out()
                update = get.result()
                if update.error is not None:
                    raise ApiError(500, update.error, kind="server_error")
                tokens += update.tokens
                if update.finish_reason is not None:
                    break
        finally:
            gone.cancel()
        text = output_text(tokens, tokenizer, cfg.eos_ids, p.stop)
        created = int(time.time())
        if p.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": update.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": update.finish_reason, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": p.model,
                             "choices": [choice], "usage": _usage(p, len(tokens)), "mtp_stats": update.stats})

    async def _stream(handle: Handle, p: ParsedRequest, rid: str) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"

        def event(choices: list, **extra) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": p.model, "choices": choices, **extra}
            return f"data: {json.dumps(body)}\n\n"

        def chunk(delta: dict, finish_reason: str | None = None, **extra) -> str:
            """`delta`: the chat delta ({"content": ...}); completions send its content as text."""
            if p.kind == "chat":
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish_reason,
                          "logprobs": None}
            return event([choice], **extra)

        text = TextStream(tokenizer, cfg.eos_ids, p.stop)
        done = False
        try:
            if p.kind == "chat":
                yield chunk({"role": "assistant", "content": ""})
            n = 0
            while True:
                try:
                    update = await asyncio.wait_for(handle.updates.get(), time_left(handle))
                except TimeoutError:
                    yield f"data: {json.dumps(timed_out().body())}\n\n"     # `done` stays False: aborted below
                    break
                if update.error is not None:
                    done = True
                    err = ApiError(500, update.error, kind="server_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                n += len(update.tokens)
                final = update.finish_reason is not None
                delta = text.feed(update.tokens, final)
                if delta:
                    yield chunk({"content": delta})
                if final:
                    done = True
                    yield chunk({}, update.finish_reason, mtp_stats=update.stats)
                    if p.include_usage:
                        yield event([], usage=_usage(p, n))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not done:          # the client went away mid-stream: free the slot
                worker.abort(handle)

    return app
