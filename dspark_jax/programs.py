"""The compiled programs an engine keeps, within the process's memory-mapping limit.

XLA:CPU keeps each compiled program's kernels in memory mappings of their own (the demo pair's
step program: ~530-680, two or three per kernel), and Linux caps a process's mappings
(`vm.max_map_count`, 65,530 by default): past the cap the next compile fails and the process dies.
A process that compiles more than about a hundred programs (engines over several models or cache
geometries, each with its batch x speculation length x prompt chunk shapes) would pass it.
So an engine holds one jit per program shape (`CompiledPrograms`): dropping a jit releases its
executable and its mappings, and after each new program the least recently used ones are dropped
while the process holds more than `EVICT_SHARE` of its limit. A dropped program called again is
compiled again (from the persistent compilation cache where it is on: a load, not a compile).
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Hashable, NamedTuple

import jax

log = logging.getLogger("dspark_jax")

# programs are dropped past this share of the mapping limit, down to `KEEP_SHARE` (room for the
# next few compiles without dropping on every one); the warm-up stops below, at `warmup.MAPPINGS_SHARE`
EVICT_SHARE = 0.8
KEEP_SHARE = 0.7


def memory_mappings() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's per-process limit), or None where the
    system does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
        return held, int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


class Program(NamedTuple):
    jitted: Callable                 # a jax.jit of its own: dropping it drops its executable
    tag: Hashable                    # what the caller calls this program (e.g. `scheduler.StepProgram`)


class CompiledPrograms:
    """One jit per program shape, in order of last use. `mappings()` says what the process holds
    (`memory_mappings`; None: no limit known, nothing is dropped)."""

    def __init__(self, mappings: Callable[[], tuple[int, int] | None] = memory_mappings):
        self._programs: OrderedDict[Hashable, Program] = OrderedDict()
        self._mappings = mappings
        self.dropped = 0                # programs dropped so far

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, key: Hashable, fn: Callable, jit_kw: dict, tag: Hashable = None) -> tuple[Callable, bool]:
        """(the jit of `key`, whether it is new); a new one wraps `fn` in a function object of its
        own (jit's caches hold a function's programs by that object)."""
        program = self._programs.get(key)
        if program is not None:
            self._programs.move_to_end(key)
            return program.jitted, False
        self._programs[key] = Program(jax.jit(functools.partial(fn), **jit_kw), tag)
        return self._programs[key].jitted, True

    def tags(self) -> set:
        """The tags of the programs held (compiled, or about to be by the call that made them)."""
        return {p.tag for p in self._programs.values() if p.tag is not None}

    def compiled(self) -> int:
        """Executables held by all the jits (one each, once called or compiled)."""
        return sum(p.jitted._cache_size() for p in self._programs.values())

    def trim(self) -> int:
        """After a new program: while the process holds more than `EVICT_SHARE` of its mapping
        limit, drop least recently used programs (never the newest) until it holds at most
        `KEEP_SHARE`. Returns the programs dropped."""
        held = self._mappings()
        if held is None or held[0] <= EVICT_SHARE * held[1]:
            return 0
        dropped, first = 0, held[0]
        while len(self._programs) > 1 and held is not None and held[0] > KEEP_SHARE * held[1]:
            self._programs.popitem(last=False)
            dropped += 1
            held = self._mappings()
        self.dropped += dropped
        log.info("dropped the %d least recently used compiled programs (memory mappings %d -> %s of the limit "
                 "of %d, vm.max_map_count); %d kept", dropped, first, held[0] if held else "?",
                 held[1] if held else 0, len(self._programs))
        return dropped

    def clear(self) -> None:
        """Drop every program."""
        self._programs.clear()
