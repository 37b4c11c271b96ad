"""Warm start: initialise a DSpark draft from its target where shapes allow.

After SpecForge's kan-ablations ("Warm start"): a draft initialised
from target layers reached train accuracy 0.45 where random init had 0.05-0.19 after the same
940 steps. Whether it helps OUR drafts is an open measurement (README, training section: the
warm-vs-random ablation at equal CPU time); nothing here claims it does.

The mapping (`plan` returns it, `warm_start` applies it; every copy requires equal shapes):
- draft layer j of n_d  <-  target layer n_t - n_d + j (the target's LAST n_d layers, in order):
  `mlp.{gate,up,down}_proj.weight`, `input_layernorm.weight`, `post_attention_layernorm.weight`
  (targets whose layer has no dense `mlp.gate_proj`, e.g. Kimi's MoE layers, keep the draft's).
- `final_norm.weight`  <-  the target's final norm `model.norm.weight` (both feed the lm_head).
- `context_proj.weight` [H, n_aux * H_t]: the block that reads the LAST captured aux layer is
  `context_scale * eye(H, H_t)`; the blocks of the other aux layers are zero. (context_norm follows,
  an RMS norm, so the scale only sets the gradient size; it stays at its init, ones.)
- Markov head: `markov_w2` (the output side, bias = W1[prev] W2^T) = 0, so the bias starts at 0;
  `markov_w1` keeps its random init (its gradient is zero until W2 moves, as in LoRA's zero B).
- Confidence head: `proj.weight` = 0 and `proj.bias` = logit(confidence_prior); the default prior
  0.5 gives bias 0, i.e. confidence sigmoid(0) = 0.5 for every position (no opinion).
- Attention (`self_attn.*`, MLA) stays random: the target's attention is GQA, not MLA.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dspark_jax import params as params_lib

_LAYER_TENSORS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                  "input_layernorm.weight", "post_attention_layernorm.weight")


class WarmStartError(ValueError):
    """The draft and target cannot be paired (a clear message naming the tensor)."""


@dataclasses.dataclass(frozen=True)
class Assignment:
    """One draft tensor's new value: `source` names the target tensor it copies, or the rule."""
    name: str
    source: str
    value: jax.Array
    from_target: bool = False


def _target_prefix(flat_t: dict) -> str:
    """`model.` for HF-layout targets (`model.layers.0...`), `language_model.model.` etc. otherwise."""
    for name in flat_t:
        if name.endswith("layers.0.input_layernorm.weight"):
            return name[: -len("layers.0.input_layernorm.weight")]
    raise WarmStartError("the target has no `layers.0.input_layernorm.weight`: cannot find its decoder layers")


def plan(draft, target, *, context_scale: float = 1.0, confidence_prior: float = 0.5) -> list[Assignment]:
    """The warm-start assignments for `draft` from `target` (nothing is modified)."""
    if not 0.0 < confidence_prior < 1.0:
        raise WarmStartError(f"confidence_prior must be in (0, 1), got {confidence_prior}")
    flat_d = params_lib.flat_params(draft)
    flat_t = params_lib.flat_params(target)
    dcfg = draft.cfg
    pre = _target_prefix(flat_t)
    n_t = sum(1 for n in flat_t if n.startswith(pre + "layers.") and n.endswith(".input_layernorm.weight"))
    n_d = dcfg.num_hidden_layers
    out: list[Assignment] = []

    def copy(dst: str, src: str) -> None:
        if dst not in flat_d:
            raise WarmStartError(f"draft tensor {dst} does not exist")
        if src not in flat_t:
            return                                        # e.g. a MoE layer: no dense MLP to copy
        d, s = flat_d[dst].get_value(), flat_t[src].get_value()
        if d.shape != s.shape:
            return                                        # shapes do not allow: keep the draft's init
        out.append(Assignment(dst, src, s.astype(d.dtype), from_target=True))

    for j in range(n_d):
        i = n_t - n_d + j
        if i < 0:
            continue                                      # more draft layers than target layers
        for t in _LAYER_TENSORS:
            copy(f"layers.{j}.{t}", f"{pre}layers.{i}.{t}")
    copy("final_norm.weight", f"{pre}norm.weight")

    w = flat_d["context_proj.weight"].get_value()
    h, h_t, n_aux = dcfg.hidden_size, dcfg.target_hidden_size, dcfg.num_aux
    if w.shape != (h, n_aux * h_t):
        raise WarmStartError(f"context_proj.weight has shape {w.shape}, expected {(h, n_aux * h_t)}")
    new = jnp.zeros(w.shape, w.dtype).at[:, (n_aux - 1) * h_t:].set(
        (context_scale * jnp.eye(h, h_t)).astype(w.dtype))
    out.append(Assignment("context_proj.weight",
                          f"{context_scale} * identity on aux layer {dcfg.target_layer_ids[-1]}, zero elsewhere", new))

    if "markov_head.markov_w2.weight" in flat_d:
        v = flat_d["markov_head.markov_w2.weight"].get_value()
        out.append(Assignment("markov_head.markov_w2.weight", "zeros", jnp.zeros_like(v)))
    if "confidence_head.proj.weight" in flat_d:
        v = flat_d["confidence_head.proj.weight"].get_value()
        out.append(Assignment("confidence_head.proj.weight", "zeros", jnp.zeros_like(v)))
        b = flat_d["confidence_head.proj.bias"].get_value()
        logit = math.log(confidence_prior / (1.0 - confidence_prior))
        out.append(Assignment("confidence_head.proj.bias", f"logit({confidence_prior}) = {logit:.4g}",
                              jnp.full(b.shape, logit, b.dtype)))
    return out


def warm_start(draft, target, *, context_scale: float = 1.0, confidence_prior: float = 0.5,
               log=None):
    """Overwrite `draft`'s parameters in place by `plan(...)` (each new value placed with the old
    value's sharding) and return the draft. `log(msg)` receives a one-line summary."""
    assignments = plan(draft, target, context_scale=context_scale, confidence_prior=confidence_prior)
    flat_d = params_lib.flat_params(draft)
    for a in assignments:
        var = flat_d[a.name]
        old = var.get_value()
        value = a.value
        sharding = getattr(old, "sharding", None)
        if sharding is not None:
            value = jax.device_put(value, sharding)
        var.set_value(value)
    if log is not None:
        copied = [a for a in assignments if a.from_target]
        layers = sorted({int(a.source.split("layers.")[1].split(".")[0]) for a in copied if "layers." in a.source})
        log(f"warm start: {len(copied)} tensors copied from the target (MLP + norms of target layers {layers} -> "
            f"draft layers 0..{draft.cfg.num_hidden_layers - 1}, final norm); context_proj = {context_scale} x "
            f"identity on aux layer {draft.cfg.target_layer_ids[-1]}; markov_w2 = 0; confidence head weight 0, "
            f"bias logit({confidence_prior}); attention random")
    return draft
