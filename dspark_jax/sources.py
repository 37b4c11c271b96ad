"""Which directory a loaded model came from (to find its tokenizer beside it)."""

from __future__ import annotations

import weakref
from typing import Any

_SOURCES: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def register_source(model, directory) -> None:
    _SOURCES[model] = str(directory)


def source_of(model) -> str | None:
    """The directory `model` was loaded from (None if it was built in memory)."""
    return _SOURCES.get(model)
