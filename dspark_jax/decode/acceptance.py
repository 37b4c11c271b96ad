"""Acceptance measured one way: a draft's tok/fwd over prompts, through `generate()` (the `Engine`
and the `Scheduler` the server runs), with each prompt's statistics.

Three callers read their figures from it: the acceptance card (`serving/card.py`, one prompt a
call: a conversation's turns follow its own answers), the drafts' comparison
(`benchmarks/acceptance.py`, batches) and the held-out eval of a training run
(`train/monitor.py`, batches on a kept engine). At temperature 0 a greedy speculative output is the
target's own greedy output, so tok/fwd does not depend on the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dspark_jax.decode.generate import RequestOutput, generate
from dspark_jax.decode.stats import SpecStats


@dataclass
class AcceptanceRun:
    outputs: list[RequestOutput] = field(default_factory=list)   # per prompt, in order
    per_prompt: list[SpecStats] = field(default_factory=list)    # each prompt's statistics
    stats: SpecStats | None = None                               # every prompt's, merged

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def measure_acceptance(target, draft, prompts: Sequence[Any], *, max_new_tokens: int,
                       num_speculative_tokens: int = 7, batch_size: int = 8, temperature: float = 0.0,
                       seed: int = 0, engine=None, tokenizer=None, max_model_len: int | None = None,
                       max_num_batched_tokens: int | None = None,
                       on_batch: Callable[[int, AcceptanceRun], None] | None = None) -> AcceptanceRun:
    """Generate for `prompts` (strings, conversations or token ids; chat template on) in batches of
    `batch_size` and collect the statistics: greedy at `temperature` 0 (else sampled, the draws
    from `seed` per batch). `engine`: a kept `Engine` whose compiled programs are reused (its T is
    `num_speculative_tokens`). Every step verifies all T drafts (`speculative_length="fixed"`):
    acceptance is a property of the draft at T, not of how a host's costs would shorten the
    steps. `max_num_batched_tokens`: prompt tokens prefilled per engine step (None: whole prompts).
    `on_batch(done, run)` is called after every batch."""
    run = AcceptanceRun()
    for i in range(0, len(prompts), batch_size):
        res = generate(target, draft, prompts[i:i + batch_size], max_new_tokens=max_new_tokens,
                       num_speculative_tokens=num_speculative_tokens, temperature=temperature, seed=seed,
                       engine=engine, tokenizer=tokenizer, max_model_len=max_model_len,
                       speculative_length="fixed", max_num_batched_tokens=max_num_batched_tokens)
        for out in res.outputs:
            stats = SpecStats.from_dict(out.stats)
            run.outputs.append(out)
            run.per_prompt.append(stats)
            if run.stats is None:
                run.stats = SpecStats(stats.num_speculative_tokens)
            run.stats.merge(stats)
        if on_batch is not None:
            on_batch(min(i + batch_size, len(prompts)), run)
    return run
