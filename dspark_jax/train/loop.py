"""The training loop around a `Trainer`: steps until the end or a stop, a line of progress per
`log_every` steps, metrics.jsonl and TensorBoard, checkpoints with the data position, held-out
evaluations and the learning curve, and exports of the draft in the torch layout."""


from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import jax

from dspark_jax.train.batches import collate
from dspark_jax.train.monitor import EvalHistory
from dspark_jax.train.trainer import Trainer


def _truncate_metrics(path: Path, last_step: int) -> None:
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _fmt_eta(seconds: float) -> str:
    h, rem = divmod(int(seconds), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def _cpu_seconds_so_far(path: Path) -> float:
    """The run's cumulative training CPU seconds: the last metrics row's `cpu_seconds`."""
    last = 0.0
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                last = json.loads(line).get("cpu_seconds", last)
    return last


def run(trainer: Trainer, source, *, stop_after: int | None = None, stop_at: int | None = None, evaluator=None,
        cpu_budget: float | None = None, time_budget: float | None = None) -> list[dict]:
    """Train to `cfg.total_steps` (or `stop_after` more steps, or to step `stop_at`: a
    constant-lr run stopped at a chosen step, saved and exported there), resuming from the run
    dir's latest checkpoint. Returns the metrics of the steps run by this call. `evaluator(draft) ->
    {"tok_per_fwd", ...}` (e.g. `monitor.HeldOutEval`) runs every `cfg.eval_every` steps.

    Every step records its process CPU seconds (all threads; evaluation excluded) and the run's
    running total `cpu_seconds`, which survives resumption; with `cpu_budget` the run saves,
    exports and stops at the first step that brings the total to the budget (the equal-CPU-time
    ablations compare runs whose steps cost differently). `time_budget` does the same once this
    call has run that many wall-clock seconds (a run on a machine available for a fixed time)."""
    cfg = trainer.cfg
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = trainer.restore_latest()
    start = int(trainer.state.step)
    if meta is not None:
        source.restore(meta["data_position"])
        trainer.log(f"resumed from step {start} ({run_dir / 'checkpoints'})")
    metrics_path = run_dir / "metrics.jsonl"
    lead = jax.process_index() == 0       # one writer of metrics files in a multi-process run
    tb = None
    if lead:
        _truncate_metrics(metrics_path, start)
        from tensorboardX import SummaryWriter
        tb = SummaryWriter(str(run_dir / "tb"), purge_step=start + 1 if start else None)
    cpu_total = _cpu_seconds_so_far(metrics_path) if lead else 0.0
    offline = not trainer.online
    evals = None
    if evaluator is not None and cfg.eval_every > 0 and lead:
        evals = EvalHistory(run_dir)
        done = {r["step"] for r in evals.truncate(start)}
        if start not in done:        # the curve's first point: the initial (or restored) weights
            _evaluate(trainer, evaluator, evals, tb, start, None, cpu_total)
    history = []
    end = cfg.total_steps if stop_after is None else min(cfg.total_steps, start + stop_after)
    if stop_at is not None:
        end = min(end, stop_at)
    t_start, last_saved = time.time(), start
    deadline = None if time_budget is None else t_start + time_budget
    if cpu_budget is not None and cpu_total >= cpu_budget:
        trainer.log(f"CPU budget {cpu_budget:.0f}s already spent ({cpu_total:.0f}s at step {start})")
        end = start
    try:
        for step in range(start, end):
            c0 = time.process_time()
            batch = collate(source.take(cfg.global_batch), cfg, offline)
            t0 = time.time()
            m = trainer.step(batch)
            m["step"] = step + 1
            m["step_seconds"] = time.time() - t0
            m["step_cpu_seconds"] = time.process_time() - c0
            cpu_total += m["step_cpu_seconds"]
            m["cpu_seconds"] = cpu_total
            out_of_time = deadline is not None and time.time() >= deadline
            over_budget = (cpu_budget is not None and cpu_total >= cpu_budget) or out_of_time
            history.append(m)
            if lead:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                for k, v in m.items():
                    if k != "step":
                        tb.add_scalar(f"train/{k.replace('@', '_at_')}", v, step + 1)
                tb.add_scalar("train/sequences_seen", (step + 1) * cfg.global_batch, step + 1)
            if (step + 1) % cfg.log_every == 0 or step + 1 == end:
                done = step + 1 - start
                eta = (time.time() - t_start) / done * (cfg.total_steps - step - 1)
                trainer.log(f"step {step + 1}/{cfg.total_steps} loss {m['loss']:.4f} ce {m['ce']:.3f} "
                            f"l1 {m['l1']:.3f} bce {m['bce']:.3f} tau {m['tau_probabilistic']:.3f} "
                            f"acc@1 {m['accept@1']:.3f} top1 {m['top1_acc']:.3f} agree {m['teacher_agreement']:.3f} "
                            f"lr {m['lr']:.2e} gnorm {m['grad_norm']:.3f} {m['step_seconds']:.2f}s/step "
                            f"ETA {_fmt_eta(eta)}")
            if evals is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.total_steps
                                      or over_budget):
                _evaluate(trainer, evaluator, evals, tb, step + 1, m.get("tau_probabilistic"), cpu_total)
            if (step + 1) % cfg.save_every == 0 or step + 1 in (end, cfg.total_steps) or over_budget:
                trainer.save({"data_position": source.position, "step": step + 1})
                last_saved = step + 1
                if cfg.export:
                    _export_latest(trainer, run_dir, step + 1)
            if out_of_time:
                trainer.log(f"time budget spent: {time.time() - t_start:.0f}s at step {step + 1}")
                break
            if over_budget:
                trainer.log(f"CPU budget spent: {cpu_total:.0f}s of training CPU time at step {step + 1}")
                break
    finally:
        if tb is not None:
            tb.close()
    if last_saved != int(trainer.state.step):
        trainer.save({"data_position": source.position, "step": int(trainer.state.step)})
    return history


def _evaluate(trainer: Trainer, evaluator, evals, tb, step: int, train_tau: float | None,
              cpu_seconds: float | None = None) -> None:
    """One held-out eval of the current weights: a row in eval.jsonl, TensorBoard eval/*, the PNG."""
    res = evaluator(trainer.draft())
    row = {"step": step, "sequences_seen": step * trainer.cfg.global_batch, **res,
           "train_tau": None if train_tau is None else float(train_tau), "cpu_seconds": cpu_seconds}
    evals.append(row)
    tb.add_scalar("eval/tok_per_fwd", res["tok_per_fwd"], step)
    tb.add_scalar("eval/acceptance_rate", res["acceptance_rate"], step)
    tb.add_scalar("eval/sequences_seen", row["sequences_seen"], step)
    for k, p in enumerate(res.get("per_position_acceptance", ())):
        tb.add_scalar(f"eval/accept_at_{k + 1}", p, step)
    tb.flush()
    png = evals.plot()
    trainer.log(f"eval step {step} ({row['sequences_seen']} sequences seen): held-out tok/fwd "
                f"{res['tok_per_fwd']:.3f} acceptance {res['acceptance_rate']:.3f} on {res.get('prompts', '?')} "
                f"prompts ({res.get('eval_seconds', 0.0):.1f}s); curve {png}")


def _export_latest(trainer: Trainer, run_dir: Path, step: int) -> None:
    root = run_dir / "export"
    dst = root / f"step_{step:07d}"
    if dst.exists():
        return
    trainer.export(dst)
    others = sorted(d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_") and d != dst)
    older = [d for d in others if d.name < dst.name]
    redone = [d for d in others if d.name > dst.name]      # steps a resumed run is doing again
    for old in redone + older[:max(0, len(older) - (trainer.cfg.keep_exports - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    trainer.log(f"exported the draft (torch layout) to {dst}")
