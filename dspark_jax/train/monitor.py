"""Held-out served acceptance during training: eval, history, learning curve.

- `HeldOutEval`: served tok/fwd of the CURRENT draft weights on a small fixed prompt set, through
  the serving path (`acceptance.measure_acceptance`: `generate()`, temperature 0, chat template for
  text prompts). The default set is GSM8K-test prompts 60..60+N: `benchmarks.acceptance` measures the first 60, so the training
  curve never looks at the benchmark's prompts. One `Engine` is kept and only its draft state is
  swapped per eval, so the compiled programs are reused (a fresh draft object would recompile).
- `EvalHistory`: `<run_dir>/eval.jsonl`, one row per eval {step, sequences_seen, tok_per_fwd,
  acceptance_rate, per_position_acceptance, train_tau, ...}; a resumed run truncates it to the
  restored step and continues it, and `<run_dir>/learning_curve.png` is redrawn from the whole
  history after every eval (matplotlib, Agg backend; written to a temp file, then renamed).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from flax import nnx

from dspark_jax.data.eval_sets import load_gsm8k
from dspark_jax.decode.acceptance import measure_acceptance
from dspark_jax.decode.config import EngineConfig
from dspark_jax.decode.engine import Engine, cast_floating
from dspark_jax.decode.requests import encode_prompt, tokenizer_for

EVAL_FILE = "eval.jsonl"
CURVE_FILE = "learning_curve.png"
GSM8K_BENCHMARK_PROMPTS = 60      # benchmarks.acceptance --gsm8k 60 reads GSM8K test[0:60]


def gsm8k_heldout_prompts(n: int, start: int = GSM8K_BENCHMARK_PROMPTS) -> list[list[dict]]:
    """GSM8K-test prompts start..start+n as chat conversations (one user turn each)."""
    if start < GSM8K_BENCHMARK_PROMPTS:
        raise ValueError(f"held-out prompts must start at >= {GSM8K_BENCHMARK_PROMPTS} (the acceptance "
                         f"benchmark's GSM8K prompts), got {start}")
    items = load_gsm8k(limit=start + n)
    return [it.conversation() for it in items[start:start + n]]


def read_prompts_file(path: str | os.PathLike) -> list[Any]:
    """Prompts from a JSONL file: rows {"prompt_ids": [...]} (token ids, no template), {"messages":
    [...]} (a conversation) or {"prompt": "..."} (one user turn)."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        for key in ("prompt_ids", "messages", "prompt"):
            if key in row:
                out.append(row[key])
                break
        else:
            raise ValueError(f"{path}:{i + 1}: a prompt row needs one of prompt_ids, messages, prompt")
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


class HeldOutEval:
    """Served tok/fwd of a draft on fixed prompts (greedy, `num_speculative_tokens` drafts)."""

    def __init__(self, target, prompts: Sequence[Any], *, max_new_tokens: int = 128,
                 num_speculative_tokens: int = 7, batch_size: int = 8):
        if not prompts:
            raise ValueError("HeldOutEval: no prompts")
        ids_only = all(isinstance(p, (list, tuple)) and p and all(isinstance(x, int) for x in p) for p in prompts)
        try:      # loaded once: the chat template for text prompts, the tokenizer's end-of-turn ids
            tokenizer = tokenizer_for(target)
        except FileNotFoundError as e:
            if not ids_only:
                raise ValueError(f"held-out text prompts need the target's tokenizer: {e}") from e
            tokenizer = _IdsOnlyTokenizer()       # a target directory without tokenizer files (tests)
        self.tokenizer = tokenizer
        self.target = target
        self.prompts = [encode_prompt(p, tokenizer, True, f"held-out prompt {i}") for i, p in enumerate(prompts)]
        self.max_new_tokens, self.t, self.batch_size = max_new_tokens, num_speculative_tokens, batch_size
        self._engine = None

    def _engine_for(self, draft):
        if self._engine is None:
            self._engine = Engine(self.target, draft, EngineConfig(num_speculative_tokens=self.t))
        else:   # same structure, new weights: reuse the compiled programs
            self._engine.draft = draft
            self._engine.d_state = cast_floating(nnx.split(draft)[1], self._engine.compute_dtype)
        return self._engine

    def __call__(self, draft) -> dict:
        t0 = time.time()
        engine = self._engine_for(draft)
        run = measure_acceptance(self.target, draft, self.prompts, max_new_tokens=self.max_new_tokens,
                                 num_speculative_tokens=self.t, batch_size=self.batch_size, engine=engine,
                                 tokenizer=self.tokenizer)
        st = run.stats.to_dict()
        return {"tok_per_fwd": st["average_tokens_per_forward"], "acceptance_rate": st["acceptance_rate"],
                "per_position_acceptance": st["per_position_acceptance"], "prompts": len(self.prompts),
                "generated_tokens": run.generated_tokens, "verify_steps": max(st["num_verify_steps"], 1),
                "eval_seconds": time.time() - t0}


class _IdsOnlyTokenizer:
    """Token-id prompts on a target without tokenizer files: end of sequence from its config only."""
    eos_token_ids = ()

    def decode(self, ids) -> str:
        return ""


class EvalHistory:
    """The eval rows of a run (`eval.jsonl`) and its learning curve (`learning_curve.png`)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / EVAL_FILE
        self.png = self.run_dir / CURVE_FILE

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:      # a line torn by a kill: the eval reruns
                pass
        return out

    def truncate(self, last_step: int) -> list[dict]:
        """Keep the rows of steps <= last_step (a resumed run continues from there)."""
        keep = [r for r in self.rows() if r["step"] <= last_step]
        if self.path.exists():
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            os.replace(tmp, self.path)
        return keep

    def append(self, row: dict) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def plot(self, title: str | None = None) -> Path:
        """Redraw the PNG from every row: served tok/fwd (and training tau, where logged) against
        sequences seen."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = self.rows()
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
        xs = [r["sequences_seen"] for r in rows]
        ax.plot(xs, [r["tok_per_fwd"] for r in rows], "o-", label="held-out served tok/fwd (temperature 0)")
        tau = [(r["sequences_seen"], r["train_tau"]) for r in rows if r.get("train_tau") is not None]
        if tau:
            ax.plot(*zip(*tau), "s--", alpha=0.7, label="training tau_probabilistic (last step)")
        ax.set_xlabel("sequences seen")
        ax.set_ylabel("tokens per target forward")
        ax.set_title(title or f"{self.run_dir.name}: {rows[-1]['prompts'] if rows else 0} held-out prompts")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        tmp = self.png.with_name(self.png.name + ".tmp.png")
        fig.savefig(tmp, format="png")
        plt.close(fig)
        os.replace(tmp, self.png)
        return self.png
