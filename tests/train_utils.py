"""Shared by the training tests: a tiny run's inputs on disk (target directory, draft config,
regen cache), as `train.distill` and scripts/gpu_distill.sh read them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dspark_jax import params as params_lib
from dspark_jax.checkpoint.safetensors_io import save_arrays

# tests/gen_utils.py tiny_llama(0)'s config
TINY_LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": None,
              "rms_norm_eps": 1e-5}


def write_tiny_run_inputs(root: Path, pair, samples) -> dict[str, Path]:
    target, draft = pair
    tdir = root / "target"
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(TINY_LLAMA))
    save_arrays(tdir / "model.safetensors", {k: np.asarray(v.get_value()) for k, v in params_lib.flat_params(target).items()})
    cfg_path = root / "draft.json"
    cfg_path.write_text(json.dumps(dict(draft.cfg.raw)))
    data = root / "regen.jsonl"
    with open(data, "w") as f:
        for s in samples:
            n = int(np.argmax(s.loss_mask))
            f.write(json.dumps({"id": s.id, "source": "t", "prompt_ids": s.input_ids[:n].tolist(),
                                "answer_ids": s.input_ids[n:].tolist(), "finish_reason": "length", "kept": True,
                                "answer_text": ""}) + "\n")
    return {"target": tdir, "draft_config": cfg_path, "data": data}


class CharTokenizer:
    """Tiny stand-in for a chat tokenizer: one id per character (mod 90)."""
    eos_token_ids = ()

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text):
        return [ord(c) % 90 for c in text]

    def encode_chat(self, messages, add_generation_prompt=True):      # no special tokens to protect
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    def decode(self, ids):
        return "".join(chr(32 + i) for i in ids)
