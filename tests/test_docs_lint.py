"""The repository speaks of the product only: no development diary, no outside paths.

Every text file `git ls-files` lists (tracked, or new and not ignored) is scanned line by line,
case-insensitively, for the phrases in PATTERNS: development sessions and their ordinals, this
project's issue numbers, "this CPU" without the model, references outside the repository, the
development machines' tooling, citations of an outside spec, run history ("the parent revision",
"earlier that day", "tried, not kept") and "T = 0" (T is the number of drafts; temperature is
spelled out). Markdown files are also scanned for DOC_PATTERNS (commit hashes, load-average notes),
and every markdown table of measured figures (tok/s, ms) must have a machine (CPU or GPU model) and
a date in its section (`tables_without_machine`). Ordinary uses of the same words are cut out of a
line first by ALLOWED (kept small; each entry says why). Binary files, images, `.gz`,
`.safetensors`, `datasets/` and this file are not scanned.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

_ORDINAL_UNITS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
PATTERNS: dict[str, str] = {
    # development sessions (an HTTP / client session is allowed below)
    "session": r"\bsessions?\b",
    # this project's issue numbers ("issue 17", "issues #3"); a public project's "vllm #42704" is fine
    "issue number": r"\bissues? #?\d+",
    # a machine named by pointing at it instead of by model and flags
    "this machine": r"\bthis (cpu|machine|host|gpu)\b",
    # paths outside the repository
    "outside path": r"\.\./shared|/work/|shared/(DESIGN|spec|data)",
    # citations of an outside spec ("spec A.5.3"); the letter is matched case-sensitively
    "spec citation": r"\bspec (?-i:[A-F])(\.\d+)*\b",
    # development-run ordinals
    "stage number": r"\bstage ?\d+\b",
    "run ordinal": (r"\b(eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth"
                    rf"|nineteenth|twentieth|twenty-({_ORDINAL_UNITS})|thirtieth|thirty-({_ORDINAL_UNITS}))\b"),
    # the development machines' tooling
    "dev tooling": r"budget_left|files_at|give_back|\blent\b|device (time|call)",
    "gpu payload": r"\.gpu_payload",
    # run history: the documents state the current result; its history is git's
    "run history": (r"\bparent revision|\b(earlier|later) (that|the same) day\b|\bthe same morning\b"
                    r"|\btried,? (and )?not kept\b|\bworktree beside\b"),
    # T is the number of drafts; temperature 0 is written as such (plain decoding: "no drafts")
    # (case-sensitive capital T; "t = 0..7" is a range)
    "T = 0": r"(?-i:\bT ?= ?0)(?![.\d])",
}
_COMPILED = {name: re.compile(rx, re.IGNORECASE) for name, rx in PATTERNS.items()}

# searched in markdown files only (code may print a load average or name a commit it reads)
DOC_PATTERNS: dict[str, str] = {
    # a commit-hash-like token: 7-40 hex digits with a digit and a letter, not inside a path or name
    "commit hash": r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/-])",
    "load average": r"\bload average\b",
}
_DOC_COMPILED = {name: re.compile(rx, re.IGNORECASE) for name, rx in DOC_PATTERNS.items()}

# a markdown table of measured figures, and what its section must name for them
_FIGURE = re.compile(r"\btok/s\b|\d\s*ms\b|\bms\b")
_MACHINE = re.compile(r"EPYC|Xeon|H100|H200|MI355X|NVIDIA|Intel|AMD", re.IGNORECASE)
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")

# (path glob or None for every file, regex): the span the regex matches is removed from the line
# before PATTERNS are searched, so an ordinary use on a line does not hide an offending phrase
# beside it.
ALLOWED: list[tuple[str | None, str]] = [
    # pytest's fixture scope, not a development session
    ("tests/*.py", r"""scope=["']session["']"""),
    # HTTP client sessions (requests / aiohttp / httpx)
    (None, r"\b(requests|aiohttp|httpx)\.\w*Session\b|\bClientSession\b"),
    # a public checkpoint pinned to its revision (docs/architecture.md's sources)
    ("docs/architecture.md", r"revision `[0-9a-f]{40}`"),
]
_ALLOWED = [(glob, re.compile(rx, re.IGNORECASE)) for glob, rx in ALLOWED]

SKIP_DIRS = ("datasets/",)
SKIP_SUFFIXES = (".safetensors", ".gz", ".png", ".jpg", ".jpeg", ".gif", ".webp", ".ico", ".pdf", ".zip",
                 ".tar", ".xz", ".npz", ".npy", ".gguf", ".bin", ".pt")


def find_hits(text: str, path: str = "") -> list[tuple[int, str, str]]:
    """(line number, pattern name, line) for every offending phrase in `text` (a file at `path`,
    relative to the repository, for path-specific allowances)."""
    allowed = [rx for glob, rx in _ALLOWED if glob is None or fnmatch.fnmatch(path, glob)]
    patterns = {**_COMPILED, **(_DOC_COMPILED if path.endswith(".md") else {})}
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        cleaned = line
        for rx in allowed:
            cleaned = rx.sub(lambda m: " " * len(m.group()), cleaned)
        for name, rx in patterns.items():
            if rx.search(cleaned):
                hits.append((i, name, line.strip()))
    if path.endswith(".md"):
        hits += [(i, "figures without a machine", text.splitlines()[i - 1].strip())
                 for i in tables_without_machine(text)]
    return hits


def tables_without_machine(text: str) -> list[int]:
    """First line numbers of the markdown tables holding measured figures (tok/s, ms) whose
    section (from the heading above to the table's end) names no CPU/GPU model or no date."""
    lines, out, section, fenced, i = text.splitlines(), [], 0, False, 0
    while i < len(lines):
        if lines[i].lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and lines[i].startswith("#"):
            section = i
        elif not fenced and lines[i].lstrip().startswith("|"):
            end = i
            while end < len(lines) and lines[end].lstrip().startswith("|"):
                end += 1
            context = "\n".join(lines[section:end])
            if _FIGURE.search("\n".join(lines[i:end])) and not (_MACHINE.search(context) and _DATE.search(context)):
                out.append(i + 1)
            i = end
            continue
        i += 1
    return out


def repo_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for rel in sorted(set(out.decode().split("\0"))):
        if not rel or rel == SELF or rel.startswith(SKIP_DIRS) or rel.lower().endswith(SKIP_SUFFIXES):
            continue
        p = ROOT / rel
        if p.is_file() and not p.is_symlink():       # deleted in the work tree: nothing to scan
            files.append(rel)
    return files


def _read_text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_the_repository_speaks_of_the_product_only():
    report = []
    for rel in repo_text_files():
        text = _read_text(ROOT / rel)
        if text is None:
            continue
        for line_no, name, line in find_hits(text, rel):
            report.append(f"{rel}:{line_no}: [{name}] {line[:160]}")
    assert not report, f"{len(report)} line(s) speak of the development, not the product:\n" + "\n".join(report)


@pytest.mark.parametrize("planted, name", [
    ("measured in the twentieth session", "session"),
    ("measured in the twentieth session", "run ordinal"),
    ("see issue 17", "issue number"),
    ("Issue #3 asks for it", "issue number"),
    ("1.9x on this CPU", "this machine"),
    ("read ../shared/data/aime2026.jsonl", "outside path"),
    ("DSPARK_DATA_DIR=/work/shared/data", "outside path"),
    ("as spec A.5.3 says", "spec citation"),
    ("the stage 29 soup", "stage number"),
    ("after the thirty-first run", "run ordinal"),
    ("carry it on a lent machine", "dev tooling"),
    ("a device call returns 8 files", "dev tooling"),
    ("python -m x --dir .gpu_payload", "gpu payload"),
    ("against the parent revision, whose steps gathered", "run history"),
    ("The same command earlier that day on another guest", "run history"),
    ("no gain measured; tried, not kept.", "run history"),
    ("the code before it (a worktree beside main)", "run history"),
    ("greedy, chat template, T = 0, batch 1", "T = 0"),
    ("tok/fwd (T=0)", "T = 0"),
    ("the code before it (commit `8d8d464^`)", "commit hash"),
    ("merged in 4acd302be9c8", "commit hash"),
    ("the host shared with other jobs, load average ~8.7", "load average"),
])
def test_the_checker_catches_planted_phrases(planted, name):
    assert name in {n for _, n, _ in find_hits(f"fine line\n{planted}\n", "README.md")}
    assert find_hits(f"fine line\n{planted}\n", "docs/x.md")[0][0] == 2          # its line number


def test_a_table_of_figures_needs_a_machine_and_a_date():
    table = "| batch | plain tok/s |\n|---:|---:|\n| 1 | 60.1 |\n"
    planted = f"## Speed\n\nThe demo pair, batch 1:\n\n{table}"
    assert tables_without_machine(planted) == [5]
    assert (5, "figures without a machine", "| batch | plain tok/s |") in find_hits(planted, "docs/benchmarks.md")
    assert tables_without_machine(f"## Speed\n\nAMD EPYC family 26, 2 cores, 2026-12-07:\n\n{table}") == []
    # a machine named under another heading does not cover the table; a table of no figures needs none
    assert tables_without_machine(f"## A\n\nAMD EPYC, 2026-12-07.\n\n## B\n\n{table}") == [7]
    assert tables_without_machine("## Flags\n\n| flag | default |\n|---|---|\n| `--tp` | 1 |\n") == []
    assert tables_without_machine(f"## S\n\n```\n{table}```\n") == []               # inside a code block


def test_ordinary_uses_pass_and_do_not_hide_a_phrase_beside_them():
    fine = ("@pytest.fixture(scope=\"session\")\n"
            "s = requests.Session()\n"
            "the specification of a draft; a spec as written; three stages; a sessionless server\n"
            "vllm #42704 and SpecForge #470 are public sources\n"
            "on an AMD EPYC with AVX-512 BF16, 2 cores\n"
            "T = 7 drafts, T + 1 tokens; at temperature 0; plain decoding (no drafts); t = 0..7\n"
            "1048576 mappings; kimi-k3-f8493a4/spec-capture.patch; float8_e4m3fn; a deadbeef token\n")
    assert find_hits(fine, "tests/test_x.py") == []
    assert find_hits("\n".join(fine.splitlines()[2:]), "docs/x.md") == []
    assert [n for _, n, _ in find_hits("at revision `" + "cf6b8244" * 5 + "`", "docs/architecture.md")] == []
    assert [n for _, n, _ in find_hits("at revision `" + "cf6b8244" * 5 + "`", "README.md")] == ["commit hash"]
    # the fixture scope is ordinary in tests only; next to it a real phrase is still found
    assert [n for _, n, _ in find_hits('@pytest.fixture(scope="session")', "serve/app.py")] == ["session"]
    assert [n for _, n, _ in find_hits('s = requests.Session()  # from the fifth session', "x.py")] == ["session"]
