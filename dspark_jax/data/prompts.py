"""The distillation prompt pool: sources, filtering, JSONL output.

Sources: GSM8K train, MATH train, IFEval prompts (all registry-fetched, sha256-checked), code
prompts built from the running interpreter's standard-library docstrings, and (on request, not in
the default pool) `magpie`: chat requests the target wrote itself (`dspark_jax.data.magpie`).
Filtering, in order: image-bearing rows (where the row has image fields), benchmark contamination
(13-gram overlap with GSM8K test, HumanEval, MT-Bench and AIME if given), exact duplicates, near
duplicates (shingle Jaccard >= 0.8), then an optional per-source cap after a seeded shuffle. The
output is a seeded shuffle of the survivors, one
`{"id", "source", "messages": [{"role": "user", "content"}]}` per line.
"""

from __future__ import annotations

import ast
import copy
import gc
import json
import os
import random
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

from dspark_jax.data import dedup, eval_sets, magpie, registry

POOL_SOURCES = ("gsm8k_train", "math_train", "ifeval", "stdlib_code")

# Row fields that carry an image in multimodal datasets; a row with any of them non-empty is dropped.
IMAGE_FIELDS = ("image", "images", "image_url", "image_path", "image_paths", "img", "picture")

FUNCTION_TEMPLATE = "Write a Python function `{name}({signature})` that does the following:\n\n{doc}"
CLASS_TEMPLATE = ("Write a Python class `{name}` (constructed as `{name}({signature})`) that does the "
                  "following:\n\n{doc}")

# Standard-library directories that are tests, demos, vendored code or tooling, not library API.
_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "lib2to3",
              "ensurepip", "pydoc_data", "__pycache__"}
_MAX_DOC_CHARS = 800  # whole docstring paragraphs are kept up to this length


@dataclass(frozen=True)
class PromptRow:
    id: str
    source: str
    text: str
    has_image: bool = False


@dataclass
class PoolResult:
    records: list[dict[str, Any]]
    stages: list[tuple[str, dict[str, int]]] = field(default_factory=list)  # (stage, per-source size)
    removed: dict[str, dict[str, int]] = field(default_factory=dict)  # reason -> source -> count


def has_image(row: Mapping[str, Any]) -> bool:
    """True when a raw row carries an image field or an image part in chat-style content."""
    if any(row.get(f) for f in IMAGE_FIELDS):
        return True
    for msg in row.get("messages") or row.get("conversations") or ():
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list) and any(
                isinstance(p, Mapping) and str(p.get("type", "")).startswith("image") for p in content):
            return True
    return False


def _jsonl_rows(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_gsm8k_train(**fetch_kw: Any) -> list[PromptRow]:
    return [PromptRow(f"gsm8k_train/{r.get('idx', i)}", "gsm8k_train", r["question"], has_image(r))
            for i, r in enumerate(_jsonl_rows(registry.fetch("gsm8k_train", **fetch_kw)))]


def load_math_train(**fetch_kw: Any) -> list[PromptRow]:
    return [PromptRow(f"math_train/{i}", "math_train", r["problem"], has_image(r))
            for i, r in enumerate(_jsonl_rows(registry.fetch("math_train", **fetch_kw)))]


def load_ifeval(**fetch_kw: Any) -> list[PromptRow]:
    return [PromptRow(f"ifeval/{r['key']}", "ifeval", r["prompt"], has_image(r))
            for r in _jsonl_rows(registry.fetch("ifeval", **fetch_kw))]


def _doc_text(doc: str) -> str | None:
    """Whole paragraphs of a docstring up to _MAX_DOC_CHARS (always the first); None if trivial."""
    paragraphs = [p.strip() for p in doc.split("\n\n") if p.strip()]
    if not paragraphs or len(paragraphs[0].split()) < 3:
        return None
    text = paragraphs[0]
    for p in paragraphs[1:]:
        if len(text) + 2 + len(p) > _MAX_DOC_CHARS:
            break
        text += "\n\n" + p
    return text


def _init_signature(cls: ast.ClassDef) -> str | None:
    """__init__'s parameters without `self`, or None when the class body defines no __init__."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = copy.copy(node.args)
            if args.posonlyargs:
                args.posonlyargs = args.posonlyargs[1:]
            elif args.args:
                args.args = args.args[1:]
            return ast.unparse(args)
    return None


def _stdlib_modules(stdlib_dir: Path) -> Iterable[tuple[str, Path]]:
    """(dotted module name, file) for public stdlib modules, in sorted path order."""
    for path in sorted(stdlib_dir.rglob("*.py")):
        rel = path.relative_to(stdlib_dir)
        parts = list(rel.parts[:-1])
        if any(p in _SKIP_DIRS or not p.isidentifier() or p.startswith("_") for p in parts):
            continue
        stem = rel.stem
        if stem != "__init__":
            if stem.startswith("_") or not stem.isidentifier():
                continue
            parts.append(stem)
        if parts:
            yield ".".join(parts), path


def _module_prompts(module: str, tree: ast.Module) -> list[PromptRow]:
    rows = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        text = _doc_text(doc) if doc and not node.name.startswith("_") else None
        if text is None:
            continue
        if isinstance(node, ast.ClassDef):
            sig = _init_signature(node)
            prompt = (CLASS_TEMPLATE.format(name=node.name, signature=sig, doc=text) if sig is not None
                      else f"Write a Python class `{node.name}` that does the following:\n\n{text}")
        else:
            prompt = FUNCTION_TEMPLATE.format(name=node.name, signature=ast.unparse(node.args), doc=text)
        rows.append(PromptRow(f"stdlib_code/{module}.{node.name}", "stdlib_code", prompt))
    return rows


def stdlib_code_prompts(stdlib_dir: str | os.PathLike | None = None) -> list[PromptRow]:
    """One prompt per public module-level function/class with a docstring, via `ast` (no imports).

    Deterministic for a given interpreter: files in sorted order, definitions in source order.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    rows: list[PromptRow] = []
    # Parsing ~9 MB of source allocates millions of short-lived (acyclic, refcount-freed) nodes; the
    # cyclic GC would rescan them over and over, which doubles the run time.
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        for module, path in _stdlib_modules(root):
            try:
                tree = ast.parse(path.read_bytes(), filename=str(path))
            except (SyntaxError, ValueError):
                continue  # a few stdlib data/template files are not valid Python for this interpreter
            rows += _module_prompts(module, tree)
    finally:
        if gc_enabled:
            gc.enable()
    return rows


def load_magpie(cache: str | os.PathLike | None, first: int | None = None) -> list[PromptRow]:
    """The accepted requests of a `python -m train.magpie` query cache (the first `first` of them
    in sampling order: the pool a cache gave before it grew)."""
    if cache is None:
        raise ValueError("the magpie source needs the query cache of `python -m train.magpie` "
                         "(--magpie_cache)")
    if not Path(cache).exists():
        raise FileNotFoundError(f"{cache}: no such magpie query cache")
    rows = [PromptRow(i, "magpie", q) for i, q in magpie.queries(cache)]
    if first is not None and first > len(rows):
        raise ValueError(f"{cache}: {len(rows)} accepted requests, fewer than the first {first} asked for")
    return rows[:first]


def load_sources(sources: Sequence[str] = POOL_SOURCES, *, magpie_cache: str | os.PathLike | None = None,
                 magpie_first: int | None = None, **fetch_kw: Any) -> dict[str, list[PromptRow]]:
    loaders: dict[str, Callable[[], list[PromptRow]]] = {
        "gsm8k_train": lambda: load_gsm8k_train(**fetch_kw),
        "math_train": lambda: load_math_train(**fetch_kw),
        "ifeval": lambda: load_ifeval(**fetch_kw),
        "stdlib_code": stdlib_code_prompts,
        "magpie": lambda: load_magpie(magpie_cache, magpie_first),
    }
    unknown = [s for s in sources if s not in loaders]
    if unknown:
        raise ValueError(f"unknown prompt sources {unknown}; known: {list(loaders)}")
    return {s: loaders[s]() for s in sources}


def build_pool(rows_by_source: Mapping[str, Sequence[PromptRow]],
               contamination: Mapping[str, Iterable[str]], *, max_per_source: int | None = None,
               seed: int = 0, ngram: int = 13, near_dup_threshold: float = 0.8,
               exclude_ids: Collection[str] = (),
               log: Callable[[str], None] | None = None) -> PoolResult:
    """Filter the rows (see module doc) and return the shuffled records with per-stage counts.

    Duplicates are resolved across sources in source order, then row order: the first copy stays.
    `exclude_ids` (the prompts of an earlier pool) are dropped after deduplication, so a pool built
    from a grown source holds only prompts new to it, near-duplicates of the earlier ones removed,
    and the earlier pool's order (and any held-out tail) stays as it was.
    """
    sources = list(rows_by_source)
    rows = [r for s in sources for r in rows_by_source[s]]
    result = PoolResult(records=[])
    say = log or (lambda _: None)

    def stage(name: str, kept: list[PromptRow]) -> None:
        counts = Counter(r.source for r in kept)
        result.stages.append((name, {s: counts.get(s, 0) for s in sources}))
        say(f"[{name}] " + ", ".join(f"{s}={counts.get(s, 0)}" for s in sources) + f", total={len(kept)}")

    def drop(reason: str, removed: Iterable[PromptRow]) -> None:
        counts = dict(Counter(r.source for r in removed))
        if counts:
            result.removed.setdefault(reason, {}).update(counts)

    stage("loaded", rows)
    drop("image", [r for r in rows if r.has_image])
    rows = [r for r in rows if not r.has_image]
    stage("no_images", rows)

    say(f"decontaminating against {', '.join(contamination)} ({ngram}-gram overlap)")
    index = dedup.NGramIndex(contamination, n=ngram)
    hits = [index.match(r.text) for r in rows]
    for bench in dict.fromkeys(h for h in hits if h is not None):
        drop(f"contaminated:{bench}", [r for r, h in zip(rows, hits) if h == bench])
    rows = [r for r, h in zip(rows, hits) if h is None]
    stage("decontaminated", rows)

    keep = dedup.exact_duplicate_mask([r.text for r in rows])
    drop("exact_duplicate", [r for r, k in zip(rows, keep) if not k])
    rows = [r for r, k in zip(rows, keep) if k]
    stage("exact_dedup", rows)

    say(f"near-duplicate search over {len(rows)} prompts (Jaccard >= {near_dup_threshold})")
    keep = dedup.near_duplicate_mask([r.text for r in rows], near_dup_threshold, seed=seed)
    drop("near_duplicate", [r for r, k in zip(rows, keep) if not k])
    rows = [r for r, k in zip(rows, keep) if k]
    stage("near_dedup", rows)

    if exclude_ids:
        exclude = set(exclude_ids)
        drop("in_earlier_pool", [r for r in rows if r.id in exclude])
        rows = [r for r in rows if r.id not in exclude]
        stage("new_only", rows)

    if max_per_source is not None:
        capped: list[PromptRow] = []
        for s in sources:
            mine = [r for r in rows if r.source == s]
            random.Random(f"{seed}:{s}").shuffle(mine)
            drop("over_max_per_source", mine[max_per_source:])
            capped += mine[:max_per_source]
        rows = capped
        stage("capped", rows)

    random.Random(seed).shuffle(rows)
    result.records = [{"id": r.id, "source": r.source, "messages": [{"role": "user", "content": r.text}]}
                      for r in rows]
    for reason, counts in result.removed.items():
        say(f"removed {sum(counts.values())} ({reason}): "
            + ", ".join(f"{s}={n}" for s, n in counts.items()))
    return result


def write_jsonl(records: Iterable[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Write atomically: a temp file next to `path`, renamed when complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def build_prompt_pool(*, sources: Sequence[str] = POOL_SOURCES, max_per_source: int | None = None,
                      aime_file: str | os.PathLike | None = None, seed: int = 0,
                      magpie_cache: str | os.PathLike | None = None, magpie_first: int | None = None,
                      exclude_ids: Collection[str] = (),
                      log: Callable[[str], None] | None = None, **fetch_kw: Any) -> PoolResult:
    """Fetch every source and benchmark set, then `build_pool`."""
    say = log or (lambda _: None)
    say(f"loading prompt sources: {', '.join(sources)}")
    rows = load_sources(sources, magpie_cache=magpie_cache, magpie_first=magpie_first, **fetch_kw)
    say("loading benchmark sets for decontamination")
    contamination = eval_sets.contamination_texts(aime_file, **fetch_kw)
    return build_pool(rows, contamination, max_per_source=max_per_source, seed=seed,
                      exclude_ids=exclude_ids, log=log)
