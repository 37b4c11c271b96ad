"""Shared by the draft tests: a tiny DSpark draft config, random torch-layout drafts saved the way
TorchSpec saves them (full and reduced vocabulary), and random block-pass inputs for it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dspark_jax.models.dspark import vocab_map_arrays
from tests.torch_ref_dspark import DSparkDraftRef

METADATA = {"torchspec_version": "0.1.0"}

# Tiny draft: 3 aux layers of a 32-wide target, 2 layers, 4 MLA heads, rank-6 Markov head. The YaRN
# ramp (low 1, high 3) falls inside the 4 rotary pairs and mscale != mscale_all_dim, so the
# ramp, the cos/sin multiplier and the mscale² temperature all matter.
TINY = {
    "architectures": ["K3DSparkModel"], "model_type": "k3_dspark",
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    "mla_use_nope": False, "mla_use_output_gate": False,
    "vocab_size": 96, "rms_norm_eps": 1e-05, "max_position_embeddings": 65536, "rope_theta": 10000.0,
    "num_target_layers": 3, "target_hidden_size": 32, "target_num_hidden_layers": 4,
    "target_layer_ids": [0, 2, 3], "mask_token_id": 95,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "markov_rank": 6, "markov_head_type": "vanilla",
    "enable_confidence_head": True, "confidence_head_with_markov": True,
    "tie_word_embeddings": False, "draft_vocab_size": 96, "_torchspec_version": "0.1.0",
    "torch_dtype": "float32",
    "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                        "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                        "mscale_all_dim": 0.8},
}


def randomize_torch(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: matrices ~ N(0, 1/fan_in), vectors ~ 1 ± 0.3, and a Markov head strong
    enough (bias std ~ 1.2 vs base logits ~ 1) that it changes some greedy drafts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "markov" in name:
                p.copy_(0.7 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))


def make_torch_draft(path: Path, cfg: dict = TINY, *, seed: int = 0, dtype=torch.float32,
                     with_embed: bool = True) -> tuple[DSparkDraftRef, torch.Tensor]:
    """A random draft saved the way TorchSpec saves one: `save_file` with the TorchSpec metadata."""
    cfg = dict(cfg, torch_dtype=str(dtype).removeprefix("torch."))
    ref = DSparkDraftRef(cfg)
    randomize_torch(ref, seed)
    embed = torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=torch.Generator().manual_seed(seed + 1))
    tensors = {k: v.to(dtype).contiguous() for k, v in ref.state_dict().items()}
    if with_embed:
        tensors["embed_tokens.weight"] = embed.to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata=METADATA)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return ref, embed


def draft_inputs(seed: int, n: int = 5):
    """Aux hidden states of `n` positions for TINY (3 aux layers of a 32-wide target) and a
    96 x 32 lm_head."""
    rng = np.random.default_rng(seed)
    aux = rng.standard_normal((n, 3 * 32)).astype(np.float32)
    lm_head = (rng.standard_normal((96, 32)) / np.sqrt(32)).astype(np.float32)
    return aux, lm_head


K_TINY = 40
KEPT_TINY = np.sort(np.random.default_rng(7).choice(96, K_TINY, replace=False))


def make_reduced_torch_draft(path: Path, kept=KEPT_TINY, *, dtype=torch.bfloat16, seed: int = 0):
    """A reduced-vocabulary draft as an EAGLE-3-style trainer would save it: the full-vocab
    reference's tensors with markov_w2 cut to the kept rows, plus `d2t` (int64) and `t2d` (bool)."""
    ref, embed = make_torch_draft(path, dtype=dtype, seed=seed)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["markov_head.markov_w2.weight"] = tensors["markov_head.markov_w2.weight"][torch.as_tensor(kept)].contiguous()
    d2t, t2d = vocab_map_arrays(kept, TINY["vocab_size"])
    tensors["d2t"], tensors["t2d"] = torch.from_numpy(d2t), torch.from_numpy(t2d)
    save_file(tensors, str(path / "model.safetensors"), metadata=METADATA)
    cfg = json.loads((path / "config.json").read_text())
    cfg["draft_vocab_size"] = len(kept)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return ref, embed

