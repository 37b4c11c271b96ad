"""Tokenizers and chat templates for target models, without transformers.

Two kinds of model directory:
- HF `tokenizer.json` (+ `tokenizer_config.json`): `Tokenizer`, backed by the `tokenizers` library
  (SmolLM2 and other Llama-family targets).
- tiktoken `tiktoken.model` + `tokenizer_config.json`: `KimiTokenizer` (Kimi-K2 / Kimi-Linear /
  Kimi-K3 layout). Special tokens and chat format come from the directory; the built-in Kimi-K2
  ones only for a directory whose `config.json` declares a K2 / Kimi-Linear model, never for K3.
Chat templates are rendered with jinja2 the way transformers does (sandboxed environment,
trim_blocks, lstrip_blocks, `raise_exception`, `tojson` with its options, `strftime_now` (Llama 3.x
templates date their system prompt with it), and the `{% generation %}` block, which renders its
body), so a model's own template gives the same prompt here as in transformers. `load_tokenizer(model_dir)` picks the class from the files present.
"""

from __future__ import annotations

import abc
import datetime
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tiktoken
import tokenizers
from tiktoken.load import load_tiktoken_bpe

Message = Mapping[str, Any]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens either as strings or as AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's tokens for training masks in
    transformers; rendering a prompt, it is its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


# stands for message i's content when locating the template's own text (private-use code points:
# no template writes them, and they hold no special token)
_CONTENT_MARK = "\ue000{}\ue001"
_CONTENT_MARK_RE = re.compile("\ue000(\\d+)\ue001")


def compile_chat_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


CHAT_TEMPLATE_SOURCES = ("tokenizer_config.json 'chat_template'", "chat_template.jinja",
                         "chat_template.json 'chat_template'")


def _named_default(template: Any) -> Any:
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _chat_template_source(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """A model's chat template, from the first of CHAT_TEMPLATE_SOURCES that has one (what
    transformers' tokenizers and processors save)."""
    template = _named_default(tokenizer_config.get("chat_template"))
    if template is None and (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _named_default(_read_json(model_dir / "chat_template.json").get("chat_template"))
    return template


class BaseTokenizer(abc.ABC):
    """Text <-> ids plus the model's chat template and stop tokens."""

    def __init__(self, chat_template: str | None, bos_token: str | None, eos_token: str | None):
        self._template = compile_chat_template(chat_template) if chat_template else None
        self.bos_token = bos_token
        self.eos_token = eos_token

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token strings in it become their ids; nothing is added."""

    @abc.abstractmethod
    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` as plain text: a special token's string in it is text, never its id."""

    @property
    @abc.abstractmethod
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ...

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        ...

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        ...

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token else None

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation."""

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     **kwargs)

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """The ids of the chat template's prompt for `messages`, with special tokens only where the
        template writes them: special-token text inside a message's content (a forged
        `<|im_end|>` turn) stays text.

        The rendered prompt is encoded whole (as transformers does) when its special tokens are
        those of the template rendered with each content replaced by a placeholder, the usual
        case. Otherwise the template's pieces around the placeholders are encoded with special
        tokens and each content as text; a template that alters content it renders (so the
        pieces do not reassemble the prompt) is refused then, rather than guessed at."""
        messages = list(messages)
        text = self.apply_chat_template(messages, add_generation_prompt)
        ids = self.encode(text)
        marks = [_CONTENT_MARK.format(i) for i in range(len(messages))]
        skeleton = self.apply_chat_template([dict(m, content=k) for m, k in zip(messages, marks)],
                                            add_generation_prompt)
        special = self.special_ids
        if [i for i in ids if i in special] == [i for i in self.encode(skeleton) if i in special]:
            return ids
        parts = _CONTENT_MARK_RE.split(skeleton)      # template, index, template, index, ..., template
        contents = [messages[int(k)]["content"] for k in parts[1::2]]
        if "".join(p for pair in zip(parts[::2], contents + [""]) for p in pair) != text:
            raise ValueError("a message's content holds special-token text, and this chat template alters "
                             "the content it renders, so it cannot be kept as text")
        out = self.encode(parts[0])
        for content, piece in zip(contents, parts[2::2]):
            out += self.encode_text(content) + self.encode(piece)
        return out


class Tokenizer(BaseTokenizer):
    """An HF `tokenizer.json` directory (loaded with the `tokenizers` library)."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
        cfg = _read_json(model_dir / "tokenizer_config.json")
        super().__init__(_chat_template_source(model_dir, cfg), _token_content(cfg.get("bos_token")),
                         _token_content(cfg.get("eos_token")))
        self._model_eos_ids = _model_eos_ids(model_dir)
        # a second instance that encodes special tokens' strings as text (a per-instance setting)
        self._plain = tokenizers.Tokenizer.from_str(self._tok.to_str())
        self._plain.encode_special_tokens = True
        self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        own = [self.token_to_id(self.eos_token)] if self.eos_token else []
        return tuple(sorted({i for i in own + self._model_eos_ids if i is not None}))


def _model_eos_ids(model_dir: Path) -> list[int]:
    """eos ids declared by config.json / generation_config.json (int or list)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        cfg = _read_json(model_dir / name)
        ids += _as_id_list(cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id")))
    return ids


# Kimi's tiktoken pre-tokenizer regex, `TikTokenTokenizer.pat_str` in Moonshot's
# tokenization_kimi.py (the same string appears in the Kimi-K2, Kimi-Linear and Kimi-K3
# snapshots; checked against copies in public repositories, e.g. troy12x/quasar-kimi).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Kimi-K2's special tokens as offsets from the first special id (= number of BPE ranks,
# 163584 in the real vocabulary): [BOS] 163584, [EOS] 163585, <|im_end|> 163586,
# <|im_user|> 163587, <|im_assistant|> 163588, <|im_system|> 163594, <|im_middle|> 163601, ...
# Source: `added_tokens_decoder` of moonshotai/Kimi-K2-Instruct tokenizer_config.json as quoted
# in several public repositories (e.g. the special-token tables in openjiuwen's tiktoken counter
# and in Kimi-K2 tiktoken->HF conversion scripts). Used only for a directory that has no
# `added_tokens_decoder` of its own AND whose config.json declares a Kimi-K2 / Kimi-Linear model.
# Kimi-K3's tokenizer_config.json names this block differently (<|end_of_msg|> 163586 = K3's
# eos_token_id in docs/architecture.md §1.1, <|open|> 163587, <|close|> 163588, <|sep|> 163589, ...) and uses another
# chat format, which this project has no copy of: a K3 directory must bring its own
# `added_tokens_decoder` and chat template, and loading one without them is an error (no fallback
# to K2's tokens or format, which would render K2 markers as plain text for K3).
KIMI_K2_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": 254,
    "[PAD]": 255,
}
KIMI_NUM_RESERVED_SPECIAL = 256

# Kimi chat format (Kimi-K2 / Kimi-Linear), used when a K2 / Kimi-Linear directory ships no template:
# <|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...<|im_end|>
# <|im_assistant|>assistant<|im_middle|>  (no newlines between turns). Moonshot's own K2 template
# also inserts a default system prompt and renders tools; a directory's template takes precedence.
KIMI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}<|im_user|>"
    "{%- elif message.role == 'assistant' -%}<|im_assistant|>"
    "{%- elif message.role in ('system', 'tool') -%}<|im_system|>"
    "{%- else -%}{{ raise_exception('unsupported role: ' ~ message.role) }}"
    "{%- endif -%}"
    "{{ message.name or message.role }}<|im_middle|>{{ message.content }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


class KimiTokenizer(BaseTokenizer):
    """Kimi's tiktoken BPE: `tiktoken.model` (base64 token + rank per line) + special tokens."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tiktoken.model"
        try:
            ranks = load_tiktoken_bpe(str(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable tiktoken rank file ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = _read_json(cfg_path)
        # "kimi_k3", "kimi_k2" or None; the built-in K2 tokens / format serve only "kimi_k2"
        self.family = kimi_family(_read_json(model_dir / "config.json"))
        k2_builtin_ok = self.family == "kimi_k2"
        whose = ("Kimi-K3's" if self.family == "kimi_k3" else
                 "this directory's (its config.json declares no Kimi-K2 / Kimi-Linear model)")
        added = cfg.get("added_tokens_decoder")
        if not added and not k2_builtin_ok:
            raise ValueError(
                f"{cfg_path}: {'no added_tokens_decoder' if cfg_path.exists() else 'file missing'}; "
                f"{whose} special tokens are read from it (Kimi-K3 names them <|end_of_msg|>, <|open|>, "
                "<|close|>, <|sep|>, ...); Kimi-K2's built-in table is used only when config.json has "
                "model_type kimi_k2 or kimi_linear")
        self._special = kimi_special_tokens(len(ranks), added or None)
        self._special_ids = frozenset(self._special.values())
        self._enc = tiktoken.Encoding(name=str(path), pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=self._special)
        template = _chat_template_source(model_dir, cfg)
        if template is None and not k2_builtin_ok:
            raise ValueError(
                f"{model_dir}: no chat template (looked for {', '.join(CHAT_TEMPLATE_SOURCES)}); {whose} "
                "chat format is the model's own template; the built-in Kimi-K2 format is used only when "
                "config.json has model_type kimi_k2 or kimi_linear")
        _check_template_tokens(template or KIMI_CHAT_TEMPLATE, self._special, model_dir,
                               "its chat template" if template else "the built-in Kimi-K2 chat format")
        template = template or KIMI_CHAT_TEMPLATE
        bos, eos = _token_content(cfg.get("bos_token", "[BOS]")), _token_content(cfg.get("eos_token", "[EOS]"))
        for key, name in (("bos_token", bos), ("eos_token", eos)):
            if key in cfg and name is not None and name not in self._special:
                raise ValueError(f"{cfg_path}: {key} {name!r} is not a special token of its "
                                 "added_tokens_decoder")
        super().__init__(template, bos, eos)
        self._model_eos_ids = _model_eos_ids(model_dir)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def encode_text(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [i for i in ids if not (skip_special_tokens and i in self._special_ids)]
        return self._enc.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        try:
            return self._enc.encode_single_token(token)
        except KeyError:
            return None

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        # the token that closes every chat turn stops generation too: <|im_end|> (K2) or
        # <|end_of_msg|> (K3, whose config.json eos_token_id 163586 it is); absent names are skipped
        names = [self.eos_token, "<|im_end|>", "<|end_of_msg|>"]
        ids = [self._special.get(n) for n in names if n] + self._model_eos_ids
        return tuple(sorted({i for i in ids if i is not None}))


# K3-only config.json keys (docs/architecture.md §1.1); one of them set marks a plain-layout (`kimi_linear`) K3
_K3_CONFIG_KEYS = ("attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate")


def kimi_family(config: Mapping[str, Any]) -> str | None:
    """What a Kimi model directory's config.json declares: "kimi_k3" (model_type kimi_k3, a KimiK3*
    architecture, or a K3 extension key set), "kimi_k2" (model_type kimi_k2 / kimi_linear without
    K3 keys: Kimi-K2 and Kimi-Linear share K2's tokenizer), or None (no or another config)."""
    text = config.get("text_config") or {}
    archs = [str(a) for a in (config.get("architectures") or []) + (text.get("architectures") or [])]
    if (config.get("model_type") == "kimi_k3" or any(a.startswith("KimiK3") for a in archs)
            or any(config.get(k) or text.get(k) for k in _K3_CONFIG_KEYS)):
        return "kimi_k3"
    if config.get("model_type") in ("kimi_k2", "kimi_linear"):
        return "kimi_k2"
    return None


_SPECIAL_LITERAL = re.compile(r"<\|[^<>|\s]+\|>")
_JINJA_COMMENT = re.compile(r"\{#.*?#\}", re.S)


def _check_template_tokens(template: str, special: Mapping[str, int], model_dir: Path, what: str) -> None:
    """Every `<|...|>` marker a chat template writes must be a special token of the tokenizer,
    else it would be tokenized as plain text and the model would see a format it was not trained on."""
    missing = sorted(set(_SPECIAL_LITERAL.findall(_JINJA_COMMENT.sub("", template))) - set(special))
    if missing:
        raise ValueError(f"{model_dir}: {what} writes {', '.join(missing)}, which "
                         f"{model_dir / 'tokenizer_config.json'} 'added_tokens_decoder' does not define as "
                         "special tokens (they would be tokenized as plain text)")


def kimi_special_tokens(num_ranks: int, added_tokens_decoder: Mapping[str, Any] | None) -> dict[str, int]:
    """Special-token map: the config's `added_tokens_decoder` or the K2 defaults, with every
    unnamed id of the reserved block [num_ranks, num_ranks + 256) as `<|reserved_token_{id}|>`."""
    if added_tokens_decoder:
        named = {_token_content(v): int(k) for k, v in added_tokens_decoder.items()}
    else:
        named = {name: num_ranks + off for name, off in KIMI_K2_SPECIAL_OFFSETS.items()}
    used = set(named.values())
    for i in range(num_ranks, num_ranks + KIMI_NUM_RESERVED_SPECIAL):
        if i not in used:
            named[f"<|reserved_token_{i}|>"] = i
    return named


def load_tokenizer(model_dir: str | Path) -> BaseTokenizer:
    """The tokenizer of a model directory, chosen by the files present."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").exists():
        return Tokenizer(model_dir)
    if (model_dir / "tiktoken.model").exists():
        return KimiTokenizer(model_dir)
    raise FileNotFoundError(f"{model_dir}: no tokenizer.json or tiktoken.model")
