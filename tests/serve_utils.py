"""Tiny target/draft checkpoints on disk for the server and benchmark tests.

The target is a 3-layer Llama (hidden 32) with SmolLM2's 49152-token vocabulary, written in the
HF layout beside SmolLM2's tokenizer files, so the chat template and tokenizer are the real ones
while a forward pass takes milliseconds. The draft is a random 2-layer DSpark draft for it in the
torch layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax.checkpoint.draft_io import save_torch_draft
from dspark_jax.checkpoint.safetensors_io import save_arrays
from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.llama import LlamaConfig
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.models.llama import LlamaModel
from tests.gen_utils import randomize

VOCAB = 49152

TARGET_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=32,
    intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32")

DRAFT_CONFIG = dict(
    architectures=["K3DSparkModel"], model_type="k3_dspark", hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, vocab_size=VOCAB, target_hidden_size=32, target_num_hidden_layers=3,
    target_layer_ids=[0, 2], num_target_layers=2, mask_token_id=VOCAB - 1, markov_rank=8,
    enable_confidence_head=True, confidence_head_with_markov=True, torch_dtype="float32",
    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=10000.0,
                         beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))


def write_tiny_target(dst: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    model = LlamaModel(LlamaConfig.from_dict(TARGET_CONFIG), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    randomize(model, seed)
    arrays = {name: np.asarray(p.get_value()) for name, p in params_lib.flat_params(model).items()}
    save_arrays(dst / "model.safetensors", arrays)
    (dst / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, dst / name)
    return dst


def write_tiny_draft(dst: Path, seed: int = 1) -> Path:
    model = K3DSparkModel(DraftConfig.from_dict(DRAFT_CONFIG), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    randomize(model, seed)
    save_torch_draft(model, DRAFT_CONFIG, dst)
    return dst
