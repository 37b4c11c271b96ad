"""Request helpers shared by `generate()`, the server, the benchmarks and answer generation: the
tokenizer beside a loaded target, prompt encoding (token ids, text, chat messages), end-of-sequence
ids, stop strings and output text."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import numpy as np

from dspark_jax.errors import RequestError
from dspark_jax.sources import source_of
from dspark_jax.tokenizer import load_tokenizer

# tokenizers per target: loading SmolLM2's tokenizer.json took ~130 ms, paid by every generate()
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def tokenizer_for(target):
    """The tokenizer of a target loaded with `load_target` (None if its directory is unknown),
    loaded once per target and directory."""
    source = source_of(target)
    if source is None:
        return None
    cached = _TOKENIZERS.get(target)
    if cached is not None and cached[0] == source:
        return cached[1]
    tok = load_tokenizer(source)
    _TOKENIZERS[target] = (source, tok)
    return tok


def eos_ids(target, tokenizer) -> set[int]:
    """Every token id that ends generation: the config's and the tokenizer's."""
    eos = {int(i) for i in target.cfg.eos_token_ids}
    if tokenizer is not None:
        eos |= set(tokenizer.eos_token_ids)
    return eos


def stop_checker(stops: Sequence[str], tokenizer) -> Callable[[list[int]], bool] | None:
    """A per-token check 'does the decoded output contain a stop string'. It runs after every
    token, so a stop string first shows up at the tail: only a window of tokens wide enough for
    the longest stop string (each token decodes to at least a byte) is decoded, not the whole
    output."""
    if not stops or tokenizer is None:
        return None
    window = 2 * max(len(s.encode()) for s in stops) + 8

    def check(out: list[int]) -> bool:
        text = tokenizer.decode(out[-window:])
        return any(s in text for s in stops)
    return check


def output_text(tokens: Sequence[int], tokenizer, eos: frozenset[int] | set[int], stops: Sequence[str]) -> str:
    """The text of generated tokens: end-of-sequence ids dropped, cut before the first stop string."""
    text = tokenizer.decode([x for x in tokens if x not in eos])
    for s in stops:
        if s in text:
            text = text[:text.index(s)]
    return text


def encode_prompt(prompt, tokenizer, chat: bool, where: str = "prompt") -> list[int]:
    """Token ids of a prompt: token ids as given, a string (wrapped as one user turn and rendered
    with the chat template when `chat`) or a list of `{"role", "content"}` messages. Message
    content is text (`encode_chat`: special tokens only from the template); a string without
    `chat` is encoded as given, special-token text included."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(x, (int, np.integer)) for x in prompt):
        return [int(x) for x in prompt]
    if tokenizer is None:
        raise RequestError(f"{where}: text prompts need a tokenizer (pass tokenizer= or load the "
                           "target with load_target so its tokenizer is found)")
    if isinstance(prompt, str):
        if not chat:
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        for j, m in enumerate(prompt):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError(f"{where}[{j}]: a message needs string 'role' and 'content'")
        return tokenizer.encode_chat(list(prompt))     # content is text: no forged control tokens
    raise RequestError(f"{where}: expected a string, a list of messages or a list of token ids")
