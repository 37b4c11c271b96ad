"""GGUF (llama.cpp) Llama checkpoint -> HF-layout directory.

Output: `model.safetensors` (HF tensor names, HF q/k row order), `config.json` (LlamaConfig
keys), `tokenizer.json` (built with the `tokenizers` library from the GGUF vocabulary) and
`tokenizer_config.json` (special tokens + chat template). `transformers.LlamaForCausalLM` and
`AutoTokenizer` load the result, which makes them an independent reference for our models.

Quantised tensors (Q4_1, Q8_0, ...) are dequantised by `gguf.quants.dequantize`; the values are
exact in float32, so `dtype="f32"` stores the quantised model losslessly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

import gguf
import ml_dtypes
import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from dspark_jax.checkpoint.safetensors_io import DTYPE_NAMES, write_streaming

Progress = Callable[[str], None]

OUTPUT_DTYPES: dict[str, np.dtype] = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
_TORCH_DTYPE_NAMES = {"f32": "float32", "bf16": "bfloat16"}

# GGUF block tensor -> HF module inside `model.layers.N` (llama.cpp's tensor names for llama).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)")

# llama.cpp pre-tokenizer names (`tokenizer.ggml.pre`, see llama-vocab.cpp). All apply GPT-2's
# byte-level regex; the digit-split family first splits off every digit (regex "\p{N}").
_GPT2_PRE = frozenset({"gpt-2"})
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})

# gguf.TokenType values.
_CONTROL, _USER_DEFINED = 3, 4

_MISSING = object()


class GGUFError(ValueError):
    """A GGUF file that cannot be converted; the message names the file."""


@dataclass(frozen=True)
class LlamaHParams:
    """The architecture numbers of a llama-family GGUF."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int


class GGUFFile:
    """An opened, validated GGUF file; every parse failure becomes a GGUFError naming it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader raises assorted types (ValueError, struct, index errors)
            raise self.error(f"not a valid GGUF file or truncated ({type(e).__name__}: {e})") from None
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise self.error(f"truncated: tensor {t.name!r} ends at byte "
                                 f"{t.data_offset + t.n_bytes}, the file has {size}")

    def error(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value; a missing key without a default is an error naming the file."""
        f = self.reader.get_field(key)
        if f is None:
            if default is _MISSING:
                raise self.error(f"metadata key {key!r} is missing")
            return default
        return f.contents()

    @cached_property
    def tokens(self) -> list[str]:
        return self.get("tokenizer.ggml.tokens")

    def special_token_id(self, kind: str) -> int | None:
        """`kind` in bos / eos / padding / unknown."""
        return self.get(f"tokenizer.ggml.{kind}_token_id", None)


def convert_gguf(src: str | Path, dst: str | Path, dtype: str = "f32",
                 progress: Progress | None = None) -> Path:
    """Convert a llama GGUF file into an HF-layout directory `dst` (absent or empty).

    Everything is written to a temporary directory beside `dst` and renamed at the end, so a
    failure leaves nothing behind."""
    dst = Path(dst)
    say = progress or (lambda _msg: None)
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(OUTPUT_DTYPES)}, got {dtype!r}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst}: destination exists and is not an empty directory")
    g = GGUFFile(src)
    say(f"read {g.path.name}: {len(g.reader.tensors)} tensors")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()  # not mkdtemp: the result keeps the umask's permissions, not 0700
    try:
        write_hf_directory(g, tmp, dtype, say)
        os.replace(tmp, dst)  # atomic; replaces only an absent or empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote {dst}")
    return dst


def write_hf_directory(g: GGUFFile, out: Path, dtype: str, say: Progress) -> None:
    """Write the four HF files for an opened GGUF into the existing directory `out`."""
    arch = g.get("general.architecture")
    if arch != "llama":
        raise g.error(f"architecture {arch!r} is not supported (only 'llama')")
    hp = read_hparams(g)
    tok = build_tokenizer(g)
    tensors = _map_tensors(g, hp)
    say(f"dequantising {len(tensors)} tensors to {dtype}")
    _write_safetensors(out / "model.safetensors", tensors, hp, OUTPUT_DTYPES[dtype], say)
    _write_json(out / "config.json", llama_config(g, hp, dtype, tied="lm_head.weight" not in tensors))
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(g, hp))


def read_hparams(g: GGUFFile) -> LlamaHParams:
    hidden = int(g.get("llama.embedding_length"))
    heads = int(g.get("llama.attention.head_count"))
    head_dim = int(g.get("llama.attention.key_length", hidden // heads))
    rope_dim = int(g.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise g.error(f"partial rotary (rope dim {rope_dim} < head dim {head_dim}) is not supported")
    if g.get("llama.rope.scaling.type", None) not in (None, "none"):
        raise g.error("rope scaling is not supported")
    return LlamaHParams(
        num_layers=int(g.get("llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(g.get("llama.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(g.get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32_value(g.get("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32_value(g.get("llama.rope.freq_base", 10000.0)),
        context_length=int(g.get("llama.context_length")),
    )


def _f32_value(x: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06; keep the shortest float32 decimal."""
    return float(str(np.float32(x)))


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a llama GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    m = _BLOCK_RE.fullmatch(stem)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{kind}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, giving HF's half-split rope row order.

    llama.cpp's converter views each head's rows as (half, i), half in {0, 1}, i < head_dim/2,
    and stores them as (i, half): the two rotated halves interleaved. Swapping back restores HF."""
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


@dataclass(frozen=True)
class _SourceTensor:
    tensor: Any        # gguf ReaderTensor
    rope_heads: int    # > 0: un-permute the rows for this many heads

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensor.shape))  # GGUF lists dims innermost first


def _map_tensors(g: GGUFFile, hp: LlamaHParams) -> dict[str, _SourceTensor]:
    out: dict[str, _SourceTensor] = {}
    for t in g.reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            raise g.error(f"tensor {t.name!r} has no Llama (HF) counterpart")
        module = name.split(".")[-2]
        out[name] = _SourceTensor(t, {"q_proj": hp.num_heads, "k_proj": hp.num_kv_heads}.get(module, 0))
    missing = [n for n in _required_names(hp) if n not in out]
    if missing:
        raise g.error(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return out


def _required_names(hp: LlamaHParams) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(hp.num_layers):
        names += [f"model.layers.{i}.{m}.weight" for m in _LAYER_TENSORS.values()]
    return names


def _dequantize(st: _SourceTensor) -> np.ndarray:
    t = st.tensor
    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(st.shape)
    return unpermute_rope_rows(w, st.rope_heads) if st.rope_heads else w


def _write_safetensors(path: Path, tensors: dict[str, _SourceTensor], hp: LlamaHParams,
                       dtype: np.dtype, say: Progress) -> None:
    """Stream tensor by tensor (peak memory: one dequantised tensor)."""
    names = sorted(tensors)
    items = [(n, DTYPE_NAMES[dtype], tensors[n].shape) for n in names]

    def chunks() -> Iterator[tuple[str, np.ndarray]]:
        layers_done = 0
        for name in names:
            yield name, np.ascontiguousarray(_dequantize(tensors[name]).astype(dtype))
            if name.endswith("mlp.down_proj.weight"):  # one per layer
                layers_done += 1
                say(f"  {layers_done}/{hp.num_layers} layers written")

    write_streaming(path, items, chunks(), metadata={"format": "pt"})


def build_tokenizer(g: GGUFFile) -> tokenizers.Tokenizer:
    """The GGUF's gpt2-style byte-level BPE as a `tokenizers.Tokenizer`."""
    model = g.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise g.error(f"tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = g.tokens
    types: list[int] = g.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise g.error("tokenizer.ggml.tokens has duplicate entries")
    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges")]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(g)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return tok


def _pre_tokenizer(g: GGUFFile) -> pre_tokenizers.PreTokenizer:
    pre = g.get("tokenizer.ggml.pre", "gpt-2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise g.error(f"pre-tokenizer {pre!r} is not supported "
                  f"(supported: {sorted(_GPT2_PRE | _DIGIT_SPLIT_PRE)})")


def llama_config(g: GGUFFile, hp: LlamaHParams, dtype: str, tied: bool) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_layers,
        "num_attention_heads": hp.num_heads,
        "num_key_value_heads": hp.num_kv_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_theta": hp.rope_theta,
        "max_position_embeddings": hp.context_length,
        "vocab_size": len(g.tokens),
        "tie_word_embeddings": tied,
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in g.reader.tensors),
        "mlp_bias": False,
        "bos_token_id": g.special_token_id("bos"),
        "eos_token_id": g.special_token_id("eos"),
        "pad_token_id": g.special_token_id("padding"),
        "torch_dtype": _TORCH_DTYPE_NAMES[dtype],
    }


def tokenizer_config(g: GGUFFile, hp: LlamaHParams) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        # The generic fast tokenizer loads tokenizer.json exactly as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": hp.context_length,
    }
    for kind, key in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"),
                      ("unknown", "unk_token")):
        token_id = g.special_token_id(kind)
        if token_id is not None:
            cfg[key] = g.tokens[token_id]
    template = g.get("tokenizer.chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    return cfg


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
