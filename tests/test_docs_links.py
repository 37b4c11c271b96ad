"""README.md and docs/*.md point at things that exist: every relative markdown link resolves to a
file or folder of the repository, and every `python -m MODULE` names a module of the repository
(benchmarks.x -> benchmarks/x.py, dspark_jax.x.y -> dspark_jax/x/y.py, a package with a
__main__.py) or one of the few outside modules in EXTERNAL_MODULES."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

# modules `python -m` may run that are not the repository's
EXTERNAL_MODULES = {"pytest", "pip", "venv", "http.server"}

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the target may be <...> and may carry a "title"
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\")?\s*\)")
_MODULE = re.compile(r"\bpython(?:3(?:\.\d+)?)?\s+-m\s+([A-Za-z_][\w.]*)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link outside code blocks and code spans."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
            out.append((i, m.group(1).strip("<>")))
    return out


def module_exists(name: str, root: Path = ROOT) -> bool:
    if name in EXTERNAL_MODULES:
        return True
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()     # a package runs its __main__


def check(text: str, doc: Path, root: Path = ROOT) -> list[str]:
    """What in `text` (the file `doc`) points at nothing: broken relative links and unknown
    `python -m` modules, one line each."""
    problems = []
    for line_no, target in links(text):
        if not target or target.startswith("#") or re.match(r"^(https?|mailto|ftp):", target, re.IGNORECASE):
            continue
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        resolved = (root / path.lstrip("/")) if path.startswith("/") else (doc.parent / path)
        if not resolved.exists():
            problems.append(f"{doc.name}:{line_no}: link to {target!r}: no such file or folder")
    for i, line in enumerate(text.splitlines(), 1):
        for m in _MODULE.finditer(line):
            name = m.group(1).rstrip(".")
            if not module_exists(name, root):
                problems.append(f"{doc.name}:{i}: `python -m {name}`: no such module in the repository")
    return problems


def test_docs_links_and_modules_resolve():
    problems = []
    for doc in doc_files():
        if doc.is_file():
            problems += [f"{doc.relative_to(ROOT).parent}/{p}".lstrip("./") for p in check(doc.read_text(), doc)]
    assert not problems, f"{len(problems)} reference(s) point at nothing:\n" + "\n".join(problems)


def test_the_checker_catches_planted_failures():
    doc = ROOT / "docs" / "planted.md"
    text = ("See [the profile](profile.md), [the card](img/demo-draft-card.png#top) and [README](../README.md#usage).\n"
            "An [anchor](#benchmarks), a [site](https://example.com/x.md) and [mail](mailto:a@b.c).\n"
            "A [missing page](no-such-page.md) and ![a missing image](img/none.png).\n"
            "`[not a link](in-a-code-span.md)`\n"
            "```\n[not a link](in-a-fence.md)\n```\n"
            "python -m benchmarks.decode_speed, python3 -m serve.generate, python -m pytest\n"
            "python -m benchmarks.no_such_bench --flag; python -m dspark_jax (a package without __main__.py)\n"
            "python -m nosuchpkg.mod\n")
    problems = check(text, doc)
    assert len(problems) == 5, problems
    assert "planted.md:3: link to 'no-such-page.md'" in problems[0]
    assert "planted.md:3: link to 'img/none.png'" in problems[1]
    assert "planted.md:9: `python -m benchmarks.no_such_bench`" in problems[2]
    assert "planted.md:9: `python -m dspark_jax`" in problems[3]
    assert "planted.md:10: `python -m nosuchpkg.mod`" in problems[4]
