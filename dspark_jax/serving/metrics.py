"""Prometheus text exposition (format 0.0.4) for the server's counters, gauges and histograms.

A tiny registry rather than a dependency: the server exports a dozen series, all updated under
one lock, and the text format is a few lines per series."""

from __future__ import annotations

import bisect
import math
import threading
from typing import Callable

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

Labels = tuple[tuple[str, str], ...]


def _fmt_labels(labels: Labels, extra: Labels = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in items)
    return "{" + body + "}"


def _escape(v: str) -> str:
    return str(v).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _num(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class Metrics:
    """Counters and histograms keyed by (name, labels); gauges are callbacks read at scrape time."""

    def __init__(self, prefix: str = "dspark"):
        self.prefix = prefix
        self._lock = threading.Lock()
        self._help: dict[str, tuple[str, str]] = {}                 # name -> (type, help)
        self._counters: dict[str, dict[Labels, float]] = {}
        self._hists: dict[str, tuple[tuple[float, ...], dict[Labels, list]]] = {}
        self._gauges: dict[str, Callable[[], dict[Labels, float]]] = {}

    def counter(self, name: str, help_text: str) -> None:
        self._help[name] = ("counter", help_text)
        self._counters.setdefault(name, {})

    def histogram(self, name: str, help_text: str, buckets=LATENCY_BUCKETS) -> None:
        self._help[name] = ("histogram", help_text)
        self._hists.setdefault(name, (tuple(buckets), {}))

    def gauge(self, name: str, help_text: str, read: Callable[[], dict[Labels, float] | float],
              kind: str = "gauge") -> None:
        """A series read at scrape time: `read()` returns a value, or {labels: value} for a
        labelled family. `kind="counter"` for totals kept elsewhere (the engine's statistics)."""
        self._help[name] = (kind, help_text)
        self._gauges[name] = lambda: (read_v if isinstance(read_v := read(), dict) else {(): read_v})

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters[name]
            series[key] = series.get(key, 0) + value

    def observe(self, name: str, value: float, **labels: str) -> None:
        buckets, series = self._hists[name]
        key = tuple(sorted(labels.items()))
        with self._lock:
            counts = series.setdefault(key, [[0] * (len(buckets) + 1), 0.0, 0])
            counts[0][bisect.bisect_left(buckets, value)] += 1
            counts[1] += value
            counts[2] += 1

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counters[name].get(tuple(sorted(labels.items())), 0)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            counters = {k: dict(v) for k, v in self._counters.items()}
            hists = {k: (b, {lk: [list(c[0]), c[1], c[2]] for lk, c in s.items()}) for k, (b, s) in self._hists.items()}
        for name, (kind, help_text) in self._help.items():
            full = f"{self.prefix}_{name}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
            if name in self._gauges or kind == "counter":
                values = self._gauges[name]() if name in self._gauges else counters[name]
                for labels, v in sorted(values.items()):
                    lines.append(f"{full}{_fmt_labels(labels)} {_num(v)}")
            else:
                buckets, series = hists[name]
                for labels, (counts, total, n) in sorted(series.items()):
                    acc = 0
                    for le, c in zip(buckets + (math.inf,), counts):
                        acc += c
                        lines.append(f"{full}_bucket{_fmt_labels(labels, (('le', _num(le)),))} {acc}")
                    lines.append(f"{full}_sum{_fmt_labels(labels)} {_num(total)}")
                    lines.append(f"{full}_count{_fmt_labels(labels)} {n}")
        return "\n".join(lines) + "\n"
