"""A tiny synthetic llama GGUF, written the way llama.cpp's converter writes one (q/k rows
permuted, byte-level BPE tokenizer, ChatML template): shared by the GGUF conversion tests and the
GPU benchmark's CPU run."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

TINY = dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48)
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]
TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reference: the q/k row permutation of llama.cpp's convert_hf_to_gguf (HF -> GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_tokens() -> list[str]:
    merged = [m.replace(" ", "") for m in TINY_MERGES]
    return TINY_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged


def tiny_hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-layout weights (float32) for the tiny config, untied lm_head."""
    rng = np.random.default_rng(seed)
    h, ffn, hd, vocab = TINY["hidden"], TINY["ffn"], TINY["head_dim"], len(tiny_tokens())
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,),
              "lm_head.weight": (vocab, h)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (TINY["heads"] * hd, h),
                   p + "self_attn.k_proj.weight": (TINY["kv_heads"] * hd, h),
                   p + "self_attn.v_proj.weight": (TINY["kv_heads"] * hd, h),
                   p + "self_attn.o_proj.weight": (h, TINY["heads"] * hd),
                   p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                   p + "mlp.down_proj.weight": (h, ffn)}
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    layer, module = hf.split(".")[2], ".".join(hf.split(".")[3:-1])
    short = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}[module]
    return f"blk.{layer}.{short}.weight"


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray] | None = None, tokenizer_model: str = "gpt2",
                    context: int = 256) -> Path:
    """The tiny config's GGUF with `weights` (default: `tiny_hf_weights()`); `context`: its
    context length (room for longer prompts)."""
    weights = tiny_hf_weights() if weights is None else weights
    tokens = tiny_tokens()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(TINY["layers"])
    w.add_context_length(context)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_dimension_count(TINY["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in TINY_SPECIALS else 1 for t in tokens])
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TINY_TEMPLATE)
    for name, arr in weights.items():
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, TINY["heads"])
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, TINY["kv_heads"])
        w.add_tensor(gguf_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
