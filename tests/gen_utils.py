"""Tiny random target/draft pairs for generation tests.

Weights are redrawn at std 1/sqrt(fan_in) (embeddings std 1): at the default 0.02 init the
logits are nearly flat and greedy argmax would hinge on 1e-7 differences, which tests nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import params as params_lib
from dspark_jax.config.draft import DraftConfig
from dspark_jax.config.llama import LlamaConfig
from dspark_jax.config.kimi import KimiConfig
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.models.kimi import KimiLinearModel
from dspark_jax.models.llama import LlamaModel


def randomize(model, seed: int, scale: float = 1.0) -> None:
    rng = np.random.default_rng(seed)
    updates = {}
    for name, p in params_lib.flat_params(model).items():
        v = p.get_value()
        if not jnp.issubdtype(v.dtype, jnp.floating):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if v.ndim >= 2:
            fan_in = v.shape[-1] if "embed_tokens" not in name else 1
            new = rng.normal(size=v.shape) * scale / np.sqrt(fan_in)
        elif "norm" in name:
            new = 1.0 + 0.1 * rng.normal(size=v.shape)
        elif leaf in ("A_log",):
            new = np.log(rng.uniform(1, 16, size=v.shape))
        else:
            new = 0.1 * rng.normal(size=v.shape)
        updates[name] = jnp.asarray(new, v.dtype)
    state = nnx.state(model, nnx.Param)
    flat = []
    for path, var in nnx.to_flat_state(state):
        key = ".".join(str(k) for k in path)
        flat.append((path, var.replace(updates[key]) if key in updates else var))
    nnx.update(model, nnx.from_flat_state(flat))


def tiny_llama(seed: int = 0, vocab: int = 96) -> LlamaModel:
    cfg = LlamaConfig.from_dict(dict(
        model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=None, rms_norm_eps=1e-5))
    model = LlamaModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    randomize(model, seed)
    return model


def tiny_draft(target, seed: int = 1, layer_ids=(0, 2), markov_rank: int = 8,
               kept_ids=None) -> K3DSparkModel:
    """`kept_ids`: ascending target ids of a reduced draft vocabulary (draft_vocab_size = len)."""
    tc = target.cfg
    extra = {} if kept_ids is None else {"draft_vocab_size": len(kept_ids)}
    cfg = DraftConfig.from_dict(dict(**extra,
        hidden_size=tc.hidden_size, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        vocab_size=tc.vocab_size, target_hidden_size=tc.hidden_size,
        target_num_hidden_layers=tc.num_hidden_layers, target_layer_ids=list(layer_ids),
        mask_token_id=tc.vocab_size - 1, markov_rank=markov_rank, enable_confidence_head=True,
        confidence_head_with_markov=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                             rope_theta=10000.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)))
    draft = K3DSparkModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    randomize(draft, seed)
    if kept_ids is not None:
        from dspark_jax.models.draft_surgery import set_vocab_map
        set_vocab_map(draft, kept_ids)
    return draft


def tiny_k3(seed: int = 0) -> KimiLinearModel:
    from tests.kimi_configs import tiny_k3_dict
    d = tiny_k3_dict(quantized=False)
    cfg = KimiConfig.from_dict(d)
    model = KimiLinearModel(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    randomize(model, seed)
    return model


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 2, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(1, vocab - 1, size=int(rng.integers(lo, hi)))] for _ in range(n)]


def answer_samples(target, max_new_tokens: int, n: int = 8, seed: int = 0) -> list:
    """The target's own greedy answers to `n` random prompts as training samples (what
    `train.regen` produces): prompt + answer ids, loss mask on the answer."""
    from dspark_jax.decode.generate import generate
    from dspark_jax.train.regen import Sample
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(0, 90, int(rng.integers(6, 14)))] for _ in range(n)]
    res = generate(target, None, prompts, max_new_tokens=max_new_tokens)
    out = []
    for i, (p, o) in enumerate(zip(prompts, res.outputs)):
        ids = np.asarray(p + o.token_ids, np.int32)
        mask = np.zeros(len(ids), bool)
        mask[len(p):] = True
        out.append(Sample(f"s{i}", ids, mask))
    return out


def same_tokens(plain, spec) -> None:
    """Every prompt's speculative output is the plain greedy output, token for token."""
    for i, (a, b) in enumerate(zip(plain.outputs, spec.outputs)):
        assert a.token_ids == b.token_ids, f"prompt {i}: speculative output differs from plain greedy"


def chi2_pvalue(counts, probs) -> float:
    """Pearson's chi-square p-value of observed `counts` against the distribution `probs`."""
    import scipy.stats
    probs = np.asarray(probs, np.float64)
    return scipy.stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue
