"""The draft a distillation run starts from (`train.distill`'s --draft_config, --init_from,
--add_layers, --draft_vocab, --warm_start), built in two parts around the target's loading:

- `prepare`: the settings checked, --init_from's torch-layout draft loaded and deepened by
  --add_layers new layers (docs/training.md), the config chosen (--draft_config wins over
  --init_from's), and with --draft_vocab the reduced vocabulary pinned to the run directory and
  --init_from's draft moved to it (`models/draft_surgery.py`);
- `finish`: with the target loaded, a fresh draft (the Trainer's own random init, same seed) given
  the target's tensors (--warm_start, `train/warm_start.py`) and/or the vocabulary map.

`None` as the draft means: the Trainer initialises it at random. Errors are `DraftInitError`s
that name the flag to fix (the program reports them as usage errors).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax import sharding as sharding_lib
from dspark_jax.checkpoint.draft_io import load_draft
from dspark_jax.config.draft import DraftConfig
from dspark_jax.models.draft_surgery import add_layers, remap_vocabulary, set_vocab_map
from dspark_jax.models.dspark import K3DSparkModel
from dspark_jax.presets import resolve_model_path
from dspark_jax.train.vocab import read_choice
from dspark_jax.train.warm_start import warm_start


class DraftInitError(ValueError):
    """A draft-initialisation setting that cannot work; the message names the flag."""


@dataclass(frozen=True)
class DraftInit:
    draft_config: str | None = None        # config.json of a fresh draft (or overriding --init_from's)
    init_from: str | None = None           # torch-layout draft directory to start from
    add_layers: int = 0                    # decoder layers added to init_from's draft
    draft_vocab: str | None = None         # vocab.json of `train.vocab`: a reduced draft vocabulary
    warm_start: bool = False               # a fresh draft initialised from the target where shapes allow
    seed: int = 0                          # the Trainer's init seed (a fresh draft built here uses it too)

    def check(self) -> None:
        """The flag combinations that cannot work, before anything loads."""
        if self.warm_start and self.init_from:
            raise DraftInitError("--warm_start initialises a fresh draft: it cannot be combined with --init_from")
        if self.add_layers and not self.init_from:
            raise DraftInitError("--add_layers grows --init_from's draft: it needs --init_from")
        if not (self.draft_config or self.init_from):
            raise DraftInitError("--draft_config or --init_from is required")


@dataclass
class InitialDraft:
    cfg: DraftConfig                       # the run's draft config (draft_vocab_size set with --draft_vocab)
    model: object | None                   # the starting draft; None: the Trainer's random init
    kept_ids: list[int] | None             # the reduced vocabulary's target ids (None: full vocabulary)


def prepare(init: DraftInit, run_dir: str | Path, mesh, log: Callable[[str], None] = print) -> InitialDraft:
    """Everything that needs no target: --init_from (+ --add_layers), the config, --draft_vocab."""
    init.check()
    model = None
    cfg = None
    if init.init_from:
        model = load_draft(resolve_model_path(init.init_from), dtype=jnp.float32, mesh=mesh)
        if init.add_layers:
            n_before = model.cfg.num_hidden_layers
            model = add_layers(model, init.add_layers)
            log(f"--init_from's {n_before} decoder layers -> {model.cfg.num_hidden_layers}: the new ones copy "
                f"layer {n_before - 1} with zero o_proj/down_proj")
        cfg = model.cfg
    if init.draft_config:
        cfg = DraftConfig.from_json(init.draft_config)
    kept_ids = None
    if init.draft_vocab:
        kept_ids = pinned_vocab(init.draft_vocab, Path(run_dir), cfg.vocab_size)
        log(f"reduced draft vocabulary: {len(kept_ids)} of {cfg.vocab_size} target ids ({init.draft_vocab})")
        cfg = DraftConfig.from_dict({**cfg.raw, "draft_vocab_size": len(kept_ids)},
                                    where=f"{init.draft_config or init.init_from} + {init.draft_vocab}")
        if model is not None:    # its weights, its Markov output side moved to the kept rows
            own = model.draft_token_ids()
            if own is not None:
                new_ids = len(set(kept_ids) - set(jax.device_get(own).tolist()))
                log(f"--init_from's vocabulary of {len(own)} ids -> {len(kept_ids)}: {new_ids} new ids start with "
                    f"a zero Markov row")
            model = remap_vocabulary(model, kept_ids)
    return InitialDraft(cfg, model, kept_ids)


def finish(initial: InitialDraft, init: DraftInit, target, mesh, log: Callable[[str], None] = print):
    """The starting draft, given the loaded target: --warm_start's and a fresh reduced draft's map
    need a model built here (the Trainer's own random init, same seed); otherwise `initial.model`."""
    if not (init.warm_start or (initial.kept_ids is not None and initial.model is None)):
        return initial.model

    model = sharding_lib.create_sharded(
        lambda: K3DSparkModel(initial.cfg, dtype=jnp.float32, rngs=nnx.Rngs(init.seed)), mesh)
    if init.warm_start:
        warm_start(model, target, log=log)
    if initial.kept_ids is not None:
        set_vocab_map(model, initial.kept_ids)
    return model


def pinned_vocab(path: str, run_dir: Path, vocab_size: int) -> list[int]:
    """The kept ids of --draft_vocab, copied to <run_dir>/vocab.json on the first run. The map is not
    a trained parameter, so checkpoints do not hold it: a resumed run must get the same file."""
    try:
        kept = read_choice(path)
    except (OSError, ValueError) as e:
        raise DraftInitError(f"--draft_vocab {path}: {e}") from None
    if not 0 < len(kept) < vocab_size or kept[-1] >= vocab_size:
        raise DraftInitError(f"--draft_vocab {path}: {len(kept)} ids (largest {kept[-1]}) do not reduce the "
                             f"target's vocabulary of {vocab_size}")
    pinned = run_dir / "vocab.json"
    if pinned.exists():
        if read_choice(pinned) != kept:
            raise DraftInitError(f"--draft_vocab {path} differs from the vocabulary this run started with "
                                 f"({pinned}): resume with that file or use a new --run_dir")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = pinned.with_suffix(".tmp")
        tmp.write_text(Path(path).read_text())
        tmp.replace(pinned)
    return kept
