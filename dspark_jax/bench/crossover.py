"""The crossover arithmetic of the paged MLA decode kernel (`benchmarks.gpu_kernel_check
--crossover` measures, `benchmarks.gpu_bench` reports; no command-line flags here, so tests and
both scripts import it).

A sweep point is `{"shape", "span", "ratio"}`: at `span` keys per sequence (the block table's
pages x page size) the kernel took `ratio` x the reference's time (None: it failed). `auto`
dispatch runs the kernel iff span >= its crossover (`dispatch.mla_paged_min_keys()`).
"""

from __future__ import annotations


def crossover_span(points: list[dict], max_ratio: float = 1.0) -> int | None:
    """The smallest measured span S such that at every measured span >= S, for every shape, the
    kernel took at most `max_ratio` x the reference's time (None: the kernel lost at the largest
    span). Points: {"span", "ratio"} (a point without a ratio, i.e. an error, counts as a loss)."""
    spans = sorted({p["span"] for p in points}, reverse=True)
    best = None
    for span in spans:
        if all(p.get("ratio") is not None and p["ratio"] <= max_ratio for p in points if p["span"] == span):
            best = span
        else:
            break
    return best


def auto_choice(points: list[dict], min_keys: int) -> list[dict]:
    """What `auto` runs at each measured point for a crossover of `min_keys` (the dispatch rule:
    the kernel iff span >= min_keys) and its time relative to the reference."""
    out = []
    for p in points:
        kernel = p["span"] >= min_keys
        ratio = (p.get("ratio") if kernel else 1.0)
        out.append({**p, "auto": "kernel" if kernel else "reference", "auto_ratio": ratio})
    return out


def crossover_report(points: list[dict], current: int, max_ratio: float = 1.0) -> dict:
    """Summary of a sweep: the measured crossover, and `auto`'s worst time / reference's over the
    measured points with the current and with the measured value."""
    measured = crossover_span(points, max_ratio)
    spans = sorted({p["span"] for p in points})
    # the kernel never won at the largest span: keep the reference at every measured span
    recommended = measured if measured is not None else (2 * spans[-1] if spans else current)
    worst = lambda n: max((q["auto_ratio"] if q["auto_ratio"] is not None else float("inf")
                           for q in auto_choice(points, n)), default=1.0)
    return {"measured_crossover": measured, "recommended_min_keys": recommended, "current_min_keys": current,
            "auto_worst_ratio_current": worst(current), "auto_worst_ratio_recommended": worst(recommended),
            "auto_never_slower_current": worst(current) <= max_ratio, "spans": spans}
