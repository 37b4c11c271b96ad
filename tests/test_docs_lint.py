"""The repository speaks of the product only: no development diary, no outside paths.

Every text file `git ls-files` lists (tracked, or new and not ignored) is scanned line by line,
case-insensitively, for the phrases in PATTERNS: development sessions and their ordinals, this
project's issue numbers, "this CPU" without the model, references outside the repository, the
development machines' tooling, and citations of an outside spec. Ordinary uses of the same words
are cut out of a line first by ALLOWED (kept small; each entry says why). Binary files, images,
`.gz`, `.safetensors`, `datasets/` and this file are not scanned.
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
}
_COMPILED = {name: re.compile(rx, re.IGNORECASE) for name, rx in PATTERNS.items()}

# (path glob or None for every file, regex): the span the regex matches is removed from the line
# before PATTERNS are searched, so an ordinary use on a line does not hide an offending phrase
# beside it.
ALLOWED: list[tuple[str | None, str]] = [
    # pytest's fixture scope, not a development session
    ("tests/*.py", r"""scope=["']session["']"""),
    # HTTP client sessions (requests / aiohttp / httpx)
    (None, r"\b(requests|aiohttp|httpx)\.\w*Session\b|\bClientSession\b"),
]
_ALLOWED = [(glob, re.compile(rx, re.IGNORECASE)) for glob, rx in ALLOWED]

SKIP_DIRS = ("datasets/",)
SKIP_SUFFIXES = (".safetensors", ".gz", ".png", ".jpg", ".jpeg", ".gif", ".webp", ".ico", ".pdf", ".zip",
                 ".tar", ".xz", ".npz", ".npy", ".gguf", ".bin", ".pt")


def find_hits(text: str, path: str = "") -> list[tuple[int, str, str]]:
    """(line number, pattern name, line) for every offending phrase in `text` (a file at `path`,
    relative to the repository, for path-specific allowances)."""
    allowed = [rx for glob, rx in _ALLOWED if glob is None or fnmatch.fnmatch(path, glob)]
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        cleaned = line
        for rx in allowed:
            cleaned = rx.sub(lambda m: " " * len(m.group()), cleaned)
        for name, rx in _COMPILED.items():
            if rx.search(cleaned):
                hits.append((i, name, line.strip()))
    return hits


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
])
def test_the_checker_catches_planted_phrases(planted, name):
    assert name in {n for _, n, _ in find_hits(f"fine line\n{planted}\n", "README.md")}
    assert find_hits(f"fine line\n{planted}\n")[0][0] == 2                   # its line number


def test_ordinary_uses_pass_and_do_not_hide_a_phrase_beside_them():
    fine = ("@pytest.fixture(scope=\"session\")\n"
            "s = requests.Session()\n"
            "the specification of a draft; a spec as written; three stages; a sessionless server\n"
            "vllm #42704 and SpecForge #470 are public sources\n"
            "on an AMD EPYC with AVX-512 BF16, 2 cores\n")
    assert find_hits(fine, "tests/test_x.py") == []
    # the fixture scope is ordinary in tests only; next to it a real phrase is still found
    assert [n for _, n, _ in find_hits('@pytest.fixture(scope="session")', "serve/app.py")] == ["session"]
    assert [n for _, n, _ in find_hits('s = requests.Session()  # from the fifth session', "x.py")] == ["session"]
