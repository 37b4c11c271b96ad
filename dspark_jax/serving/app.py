"""The OpenAI-compatible HTTP app (FastAPI): `/v1/chat/completions`, `/v1/completions` (SSE
streaming and not), `/v1/models`, `/health`, `/debug/mtp_stats` (ATOM's schema, docs/architecture.md §5.5,
cumulative since start), `/metrics` (Prometheus text).

Handlers validate and tokenize, then hand a `Request` to the `EngineWorker` (the model's one
thread) and await its `Update`s. A client that goes away (stream closed, or a non-streaming
request disconnected) aborts its request, which frees its slot. The API key is compared in
constant time; a request body over `max_request_bytes` is answered 413 without being read whole.
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

from dspark_jax.batcher import Request
from dspark_jax.errors import RequestError
from dspark_jax.generate import output_text, stop_checker
from dspark_jax.serving.metrics import Metrics
from dspark_jax.serving.protocol import ApiError, Limits, ParsedRequest, parse_chat, parse_completion
from dspark_jax.serving.worker import EngineWorker, Handle, QueueFull, Update

log = logging.getLogger("dspark_jax.serving")

DISCONNECT_POLL_S = 0.5     # how often a waiting non-streaming handler checks its client
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


class TextStream:
    """Incremental detokenization for streaming. Text is re-decoded from all tokens (BPE merges
    can change the tail); a trailing incomplete UTF-8 sequence and a tail that might start a stop
    string are held back until more tokens arrive, so the concatenated deltas equal the final
    text of a non-streaming response."""

    def __init__(self, tokenizer, eos_ids: frozenset[int], stops: list[str]):
        self.tokenizer, self.eos_ids, self.stops = tokenizer, eos_ids, stops
        self.tokens: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, tokens: list[int], final: bool) -> str:
        self.tokens += tokens
        text = output_text(self.tokens, self.tokenizer, self.eos_ids, self.stops)
        if not final:
            text = text.rstrip("\ufffd")
            text = text[:max(len(text) - self.hold, 0)]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta = text[len(self.sent):]
        self.sent = text
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

    app = FastAPI(title="dspark-jax", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):     # a bug, still answered in OpenAI's shape (and logged)
        err = ApiError(500, f"internal server error: {type(e).__name__}", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    known_paths = {"/health", "/v1/models", "/debug/mtp_stats", "/metrics", "/v1/chat/completions",
                   "/v1/completions"}

    @app.middleware("http")
    async def count(request: HttpRequest, call_next):
        response = await call_next(request)
        path = request.url.path if request.url.path in known_paths else "other"   # bounded label set
        metrics.inc("http_requests", path=path, status=str(response.status_code))
        return response

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
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    async def body_of(request: HttpRequest):
        return parse_json(await read_body(request))

    @app.get("/health")
    async def health():
        if not worker.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        authorize(request)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "dspark-jax",
             "max_model_len": cfg.max_model_len} for name in cfg.model_names]}

    @app.get("/debug/mtp_stats")
    async def mtp_stats():
        return worker.stats()

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest):
        authorize(request)
        return await generate(request, parse_chat(await body_of(request), tokenizer, limits))

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        authorize(request)
        return await generate(request, parse_completion(await body_of(request), tokenizer, limits))

    async def generate(request: HttpRequest, p: ParsedRequest) -> Response:
        req = Request(p.prompt_ids, p.max_tokens, p.temperature, p.top_p, cfg.eos_ids,
                      stop_checker(p.stop, tokenizer))
        try:
            handle = worker.submit(req, asyncio.get_running_loop())
        except QueueFull as e:
            raise ApiError(503, str(e), kind="server_overloaded", code="queue_full") from None
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

    async def _complete(request: HttpRequest, handle: Handle, p: ParsedRequest, rid: str) -> Response:
        tokens: list[int] = []
        while True:
            try:
                update = await asyncio.wait_for(handle.updates.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    worker.abort(handle)
                    return Response(status_code=499)      # nobody is listening
                continue
            if update.error is not None:
                raise ApiError(500, update.error, kind="server_error")
            tokens += update.tokens
            if update.finish_reason is not None:
                break
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
                update = await handle.updates.get()
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
