"""OpenAI request validation: JSON bodies of `/v1/chat/completions` and `/v1/completions` into
one `ParsedRequest`, or an `ApiError` naming the offending field (HTTP 400/404).

Supported: `model`, `messages` / `prompt` (one prompt: a string or token ids), `max_tokens`
(`max_completion_tokens`), `temperature`, `top_p`, `stop`, `stream`, `stream_options.include_usage`,
`seed` (only with temperature 0, where it changes nothing: sampling keys are per server, `--seed`).
Parameters that would change the output and are not implemented (n > 1, penalties, logprobs,
tools, ...) are accepted only at their neutral values; bookkeeping keys that change nothing
(`user`, `metadata`, `store`, ...) are ignored; any other key (`top_k`, `min_p`, ...) is refused,
never silently dropped. Message content and completion prompts are text: special-token text in
them stays text (`Tokenizer.encode_text`), unless the server allows it in completion prompts.
Values are checked for what would break later: non-finite numbers, lone surrogates in strings,
oversized stop strings; error messages show values shortened (`show`).
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import jinja2

from dspark_jax.decode.requests import encode_prompt
from dspark_jax.errors import RequestError
from dspark_jax.sampling import GREEDY, SamplingParams

MAX_STOP_STRINGS = 16
# the engine thread decodes a window of the output sized by the longest stop string after every token
MAX_STOP_CHARS = 256
# the chat roles OpenAI's API defines; anything else is a client error, not text for the template
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` body with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        # a lone surrogate quoted from the body would make the JSON answer unencodable
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What a request is checked against."""

    model_names: Sequence[str]
    max_model_len: int
    reserve: int                       # positions one verify step needs beyond the prompt (T + 1)
    vocab_size: int
    # special-token text in a completion prompt string becomes control tokens (else it is text)
    allow_special_tokens: bool = False


@dataclass
class ParsedRequest:
    kind: str                          # "chat" or "completion"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 40, 40, 5, 5


def show(x: Any) -> str:
    """A client value for an error message: shortened (a 1 MB string or a 1,000-deep list quoted
    whole would be a 1 MB message or a RecursionError), surrogates escaped."""
    return _REPR.repr(x)


def _text(x: str, param: str) -> str:
    """`x`, if it is valid Unicode text (JSON's \\ud800 escapes can smuggle in lone surrogates,
    which no tokenizer encodes)."""
    try:
        x.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(param, f"contains a lone surrogate {show(x[e.start:e.end])} at character {e.start} "
                          "(not valid Unicode text)") from None
    return x


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    x = body.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _bad(name, f"expected a number, got {show(x)}")
    if not math.isfinite(x) or x < lo or x > hi or (lo_open and x == lo):
        raise _bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {x}")
    return float(x)


def _flag(body: dict, name: str) -> bool:
    x = body.get(name)
    if x is None:
        return False
    if not isinstance(x, bool):
        raise _bad(name, f"expected true or false, got {show(x)}")
    return x


# the keys each endpoint reads
_SUPPORTED = {"model", "max_tokens", "temperature", "top_p", "stop", "stream", "stream_options", "seed"}
SUPPORTED = {"chat": _SUPPORTED | {"messages", "max_completion_tokens", "response_format"},
             "completion": _SUPPORTED | {"prompt"}}
# parameters that would change the output, not implemented: only their neutral values pass
NEUTRAL = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
           "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "tools": ([],),
           "functions": ([],), "suffix": ("",), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
           "parallel_tool_calls": (True, False)}
# OpenAI bookkeeping that does not change the output
IGNORED = {"user", "metadata", "store", "service_tier"}


def _reject_unsupported(body: dict, kind: str) -> None:
    for name in body:
        if name not in SUPPORTED[kind] and name not in NEUTRAL and name not in IGNORED:
            raise _bad(show(name), "unknown or unsupported parameter; this server takes "
                       f"{', '.join(sorted(SUPPORTED[kind]))} (and {', '.join(sorted(NEUTRAL))} at their "
                       "neutral values)")
    for name, ok in NEUTRAL.items():
        x = body.get(name)
        if x is not None and not any(x == v and type(x) is type(v) for v in ok):
            raise _bad(name, f"not supported by this server (got {show(x)}; only {ok[0]!r} or null)")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format", "only {'type': 'text'} is supported")


def _stops(body: dict) -> list[str]:
    x = body.get("stop")
    if x is None:
        return []
    stops = [x] if isinstance(x, str) else x
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "expected a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise _bad(f"stop[{i}]", f"at most {MAX_STOP_CHARS} characters, got {len(s)}")
        _text(s, f"stop[{i}]")
    return stops


def _model(body: dict, limits: Limits) -> str:
    model = body.get("model")
    if model is None:
        return limits.model_names[0]
    if not isinstance(model, str):
        raise _bad("model", f"expected a string, got {show(model)}")
    if model not in limits.model_names:
        raise ApiError(404, f"The model {show(model)} does not exist; this server serves "
                            f"{', '.join(limits.model_names)}", "model", code="model_not_found")
    return model


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"{where}[{j}]", "only text content parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(_text(part["text"], f"{where}[{j}].text"))
        return "".join(parts)
    raise _bad(where, f"expected a string or a list of text parts, got {type(content).__name__}")


def _encode(prompt: Any, tokenizer, chat: bool, param: str) -> list[int]:
    try:
        return encode_prompt(prompt, tokenizer, chat, param)
    except RequestError as e:
        raise ApiError(400, str(e), param) from None
    except jinja2.TemplateError as e:     # the model's chat template rejected the conversation
        raise _bad(param, f"the chat template rejected the messages: {e}") from None
    except ValueError as e:               # content with special-token text the template would alter
        raise _bad(param, str(e)) from None


def _finish(kind: str, body: dict, prompt_ids: list[int], limits: Limits, default_max_tokens: int | None
            ) -> ParsedRequest:
    n = len(prompt_ids)
    if n + limits.reserve > limits.max_model_len:
        raise ApiError(400, f"the prompt has {n} tokens; with the {limits.reserve} positions one verify step "
                            f"needs that exceeds max_model_len={limits.max_model_len}",
                       "messages" if kind == "chat" else "prompt", code="context_length_exceeded")
    room = limits.max_model_len - n
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else default_max_tokens
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise _bad(name, f"must be a positive integer, got {show(max_tokens)}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "expected an object")
    include_usage = _flag(options or {}, "include_usage")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)   # OpenAI default 1
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _bad("seed", f"expected an integer, got {show(seed)}")
    if seed is not None and temperature > 0:
        # the engine draws every row of a step from one key stream (the server's --seed), so a
        # request's samples depend on its batch: a per-request seed could not be honoured
        raise _bad("seed", "per-request seeds are not supported with temperature > 0 (sampling is seeded "
                           "once per server, its --seed); send seed only with temperature 0")
    return ParsedRequest(
        kind=kind, model=_model(body, limits), prompt_ids=prompt_ids,
        # generation also stops at max_model_len ("length"); clip rather than refuse
        max_tokens=min(int(max_tokens), room),
        sampling=SamplingParams(temperature=temperature, top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
        stop=_stops(body), stream=_flag(body, "stream"), include_usage=include_usage)


def _check_body(body: Any, kind: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    _reject_unsupported(body, kind)
    return body


def parse_chat(body: Any, tokenizer, limits: Limits) -> ParsedRequest:
    """A `/v1/chat/completions` body; the messages are rendered with the model's chat template."""
    body = _check_body(body, "chat")
    _model(body, limits)
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "required field missing")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of {'role', 'content'} objects")
    conv = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "expected an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role", "required string field missing")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}")
        if m.get("content") is None:
            raise _bad(f"messages[{i}].content", "required field missing")
        conv.append({"role": role, "content": _message_text(m["content"], f"messages[{i}].content")})
    ids = _encode(conv, tokenizer, True, "messages")
    return _finish("chat", body, ids, limits, None)


def parse_completion(body: Any, tokenizer, limits: Limits, default_max_tokens: int = 16) -> ParsedRequest:
    """A `/v1/completions` body: one prompt, a string (encoded as is, no template) or token ids."""
    body = _check_body(body, "completion")
    _model(body, limits)
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt", "required field missing")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                 # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "the prompt is empty")
        _text(prompt, "prompt")
        ids = tokenizer.encode(prompt) if limits.allow_special_tokens else tokenizer.encode_text(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(x) for x in prompt):
        bad = [x for x in prompt if not 0 <= x < limits.vocab_size]
        if bad:
            raise _bad("prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("prompt", "batched prompts are not supported; send one prompt per request")
    else:
        raise _bad("prompt", "expected a non-empty string or a non-empty list of token ids")
    if not ids:
        raise _bad("prompt", "the prompt encodes to no tokens")
    return _finish("completion", body, ids, limits, default_max_tokens)
