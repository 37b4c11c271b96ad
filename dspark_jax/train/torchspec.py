"""TorchSpec interop: start from a torch-layout draft, or resume a TorchSpec training run.

`--init_from DIR`: a torch-layout draft directory (config.json + model.safetensors, e.g. a
published draft) loaded through `checkpoint.draft_io.load_draft` in fp32; training then starts a
fresh optimizer from those weights.

Resuming a TorchSpec run. TorchSpec (lightseekorg/TorchSpec, `torchspec/training/checkpoint.py`,
`optimizer.py`, `models/dspark.py`) saves per iteration N
    <checkpoint_dir>/iter_{N:07d}/model/       torch.distributed.checkpoint (DCP) of
                                               {"model_state": {"model": {name: tensor}}}
    <checkpoint_dir>/iter_{N:07d}/optimizer/   DCP of {"optim_state": {"optim": AdamW state_dict,
                                               "fp32_params": {name: fp32 master tensor}}}
    <checkpoint_dir>/iter_{N:07d}/lr_scheduler/, rng.pt, meta.json ({"global_step", ...})
where the AdamW state_dict is torch's: {"state": {id: {"step", "exp_avg", "exp_avg_sq"}},
"param_groups": [{"params": [id, ...], "lr", "betas", "eps", "weight_decay", ...}]}, ids numbering
the trainable parameters in `named_parameters()` order (= the order of `fp32_params`; older
versions key `fp32_params` by that index as a string). Parameter names are those of the training
wrapper (`draft_model.` prefix, FSDP/compile wrappers) and may use TorchSpec's internal names
(`fc.`/`hidden_norm.`/`norm.`/`midlayer.` for context_proj/context_norm/final_norm/layers.0).

DCP's `.metadata` is a pickle, and this package never unpickles: it reads single torch-save
files, `training_checkpoint/checkpoint_N.pt`, with `torch.load(weights_only=True)` (tensors,
dicts, lists, numbers and strings only). Such a file holds the merged content above:
    {"model_state": {"model": ...}, "optim_state": {"optim": ..., "fp32_params": ...},
     "step" | "global_step" | "iteration": int}
or the flat form {"model": ..., "optimizer": ..., "step": ...}. (TorchSpec's own environment
turns an iteration directory into that with `torch.distributed.checkpoint.format_utils
.dcp_to_torch_save` on each of model/ and optimizer/.) The result becomes an ordinary Orbax
training state (fp32 params, AdamW mu/nu = exp_avg/exp_avg_sq, count = step) that the trainer
resumes from; the data order restarts at the beginning of our data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

# wrapper prefixes a training module adds in front of the draft's own names
_WRAPPERS = ("draft_model.", "module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
# TorchSpec's export renames, reversed (internal name <- exported name)
_INTERNAL = (("fc.", "context_proj."), ("hidden_norm.", "context_norm."), ("norm.", "final_norm."),
             ("midlayer.", "layers.0."))
_FROZEN = ("embed_tokens.", "lm_head.")


class TorchSpecError(ValueError):
    """A TorchSpec checkpoint that cannot be mapped onto the draft; the message names the key."""


@dataclass
class TorchSpecState:
    params: dict[str, np.ndarray]     # our param name -> fp32 master weight
    mu: dict[str, np.ndarray]         # exp_avg
    nu: dict[str, np.ndarray]         # exp_avg_sq
    step: int


def find_checkpoint(path: str | Path) -> Path:
    """A `.pt` file, or the `checkpoint_N.pt` with the largest N in a directory (or in its
    `training_checkpoint/` subdirectory)."""
    path = Path(path)
    if path.is_file():
        return path
    for d in (path, path / "training_checkpoint"):
        found = [(int(m.group(1)), f) for f in d.glob("checkpoint_*.pt")
                 if (m := re.fullmatch(r"checkpoint_(\d+)\.pt", f.name))]
        if found:
            return max(found)[1]
    raise TorchSpecError(f"{path}: no checkpoint_N.pt (looked in it and in training_checkpoint/)")


def _torch():
    """torch, which only this reader needs (the `test` and `peers` extras install it)."""
    try:
        import torch
    except ImportError:
        raise TorchSpecError("reading a TorchSpec checkpoint needs torch: pip install torch (CPU build: "
                             "pip install torch --index-url https://download.pytorch.org/whl/cpu)") from None
    return torch


def _numpy(t) -> np.ndarray:
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TorchSpecError(f"expected a tensor, got {type(t).__name__}")
    return t.detach().to(torch.float32).cpu().numpy()


def map_name(name: str, ours: set[str]) -> str | None:
    """TorchSpec parameter name -> our name, or None for the target's frozen tables."""
    changed = True
    while changed:
        changed = False
        for w in _WRAPPERS:
            if name.startswith(w):
                name, changed = name[len(w):], True
    if name.startswith(_FROZEN):
        return None
    if name in ours:
        return name
    for internal, mine in _INTERNAL:
        if name.startswith(internal) and mine + name[len(internal):] in ours:
            return mine + name[len(internal):]
    raise TorchSpecError(f"parameter {name!r} matches no draft parameter")


def _dig(ckpt: Mapping, *paths: tuple[str, ...]) -> Any:
    for path in paths:
        node: Any = ckpt
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                break
            node = node[key]
        else:
            return node
    return None


def read_torchspec_checkpoint(path: str | Path, param_names: set[str]) -> TorchSpecState:
    """Weights, AdamW moments and step of a TorchSpec checkpoint, keyed by our param names."""
    torch = _torch()

    file = find_checkpoint(path)
    ckpt = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, Mapping):
        raise TorchSpecError(f"{file}: expected a dict at the top level, got {type(ckpt).__name__}")
    model = _dig(ckpt, ("model_state", "model"), ("model",), ("state_dict",)) or {}
    optim = _dig(ckpt, ("optim_state", "optim"), ("optimizer",), ("optim",))
    masters = _dig(ckpt, ("optim_state", "fp32_params"), ("fp32_params",)) or {}

    # trainable parameter order (= AdamW ids): fp32 master names, else the model's own order
    if masters and not all(k.isdigit() for k in masters):
        order = list(masters)
    else:
        order = [k for k in model if map_name(k, param_names) is not None]
    names = [map_name(k, param_names) for k in order]
    weights = {}
    for src, dst in zip(order, names):
        if dst is None:
            continue
        if src in masters:
            weights[dst] = _numpy(masters[src])
        elif str(order.index(src)) in masters:
            weights[dst] = _numpy(masters[str(order.index(src))])
        elif src in model:
            weights[dst] = _numpy(model[src])
    missing = sorted(param_names - set(weights))
    if missing:
        raise TorchSpecError(f"{file}: no weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    mu, nu, step = {}, {}, _dig(ckpt, ("step",), ("global_step",), ("iteration",))
    if optim is not None:
        groups = optim.get("param_groups") or []
        ids = [i for g in groups for i in g.get("params", [])]
        trainable = [n for n in names if n is not None]
        if len(ids) != len(trainable):
            raise TorchSpecError(f"{file}: optimizer has {len(ids)} parameters, the checkpoint names {len(trainable)}")
        state = optim.get("state") or {}
        for pid, name in zip(ids, trainable):
            s = state.get(pid, state.get(str(pid)))
            if s is None:
                continue            # never stepped: zero moments
            mu[name], nu[name] = _numpy(s["exp_avg"]), _numpy(s["exp_avg_sq"])
            step = int(_numpy(s["step"]).reshape(-1)[0]) if "step" in s else step
    if step is None:
        raise TorchSpecError(f"{file}: no step count (expected 'step', 'global_step' or AdamW state)")
    return TorchSpecState(weights, mu, nu, int(step))


def to_train_state(ts: TorchSpecState, params_template: Mapping, tx) -> tuple[dict, Any]:
    """(params, optax opt_state) in the trainer's pure-dict layout from a TorchSpecState."""
    import jax
    import jax.numpy as jnp
    from optax import tree_utils

    def fill(src: Mapping[str, np.ndarray], tree: Mapping, prefix: str = "", zeros: bool = False) -> dict:
        out = {}
        for k, v in tree.items():
            name = f"{prefix}{k}"
            if isinstance(v, Mapping):
                out[k] = fill(src, v, name + ".", zeros)
                continue
            arr = src.get(name)
            if arr is None:
                arr = np.zeros(v.shape, np.float32)
            if tuple(arr.shape) != tuple(v.shape):
                raise TorchSpecError(f"tensor {name!r} has shape {list(arr.shape)}, the draft needs {list(v.shape)}")
            out[k] = np.asarray(arr, np.float32)
        return out

    params = fill(ts.params, params_template)
    opt_state = tx.init(jax.tree.map(jnp.asarray, params))
    opt_state = tree_utils.tree_set(opt_state, mu=fill(ts.mu, params_template), nu=fill(ts.nu, params_template),
                                    count=jnp.asarray(ts.step, jnp.int32))
    return params, opt_state
