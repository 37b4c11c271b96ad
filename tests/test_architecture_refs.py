"""Citations of docs/architecture.md resolve, and no citation of the old outside spec remains.

Code, tests and docs cite architecture facts as `docs/architecture.md §N.M` (a list continues with
`, §N.M`, `/§N.M` or `-§N.M`). Every cited number must be the number of a heading in
docs/architecture.md, and every `§N.M` inside that page must too. Citations in the old form, a
capital letter section of an outside document ("spec" + letter + numbers), must all be gone.
Files are those `git ls-files` lists (tracked, or new and not ignored); binary files and `datasets/`
are skipped, and the docs lint test, which plants old-style citations, is not searched for them.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = "docs/architecture.md"

_NUM = r"\d+(?:\.\d+)*"
HEADING = re.compile(rf"^#{{1,6}}\s+({_NUM})\s", re.MULTILINE)
# "docs/architecture.md §1.5.3", "architecture.md) §3.1/§3.2", "docs/architecture.md §4.2-§4.3, §5"
CITATION = re.compile(rf"architecture\.md(?:#[\w-]*)?[)\]]*\s*(§{_NUM}(?:\s*(?:,|/|-|–|and)\s*§{_NUM})*)")
SECTION = re.compile(rf"§({_NUM})")
OLD_SPEC = re.compile(r"\b[Ss]pec [A-F](?:\.\d+)*\b")
SKIP_DIRS = ("datasets/",)
# the lint test plants old-style citations as examples of what it rejects
PLANTED = ("tests/test_docs_lint.py",)


def headings(text: str) -> list[str]:
    return HEADING.findall(text)


def cited_sections(text: str) -> list[tuple[int, str]]:
    """(line number, section number) of every docs/architecture.md citation in `text`."""
    out = []
    for m in CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out.extend((line, n.rstrip(".")) for n in SECTION.findall(m.group(1)))
    return out


def repo_text_files() -> dict[str, str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = {}
    for rel in sorted(set(out.decode().split("\0"))):
        p = ROOT / rel
        if not rel or rel.startswith(SKIP_DIRS) or not p.is_file() or p.is_symlink():
            continue
        data = p.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            files[rel] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return files


def test_architecture_headings_are_numbered_uniquely():
    nums = headings((ROOT / DOC).read_text(encoding="utf-8"))
    assert len(nums) > 20
    assert len(nums) == len(set(nums)), sorted(n for n in nums if nums.count(n) > 1)
    # every numbered section's parent is numbered too (§1.5.3 needs §1.5 and §1)
    for n in nums:
        parts = n.split(".")
        for k in range(1, len(parts)):
            assert ".".join(parts[:k]) in nums, f"§{n} has no parent §{'.'.join(parts[:k])}"


def test_every_architecture_citation_resolves():
    doc = (ROOT / DOC).read_text(encoding="utf-8")
    known = set(headings(doc))
    files = repo_text_files()
    bad, count = [], 0
    for rel, text in files.items():
        cites = cited_sections(text)
        if rel == DOC:      # the page's own cross-references are bare "§N.M"
            cites = [(text.count("\n", 0, m.start()) + 1, m.group(1).rstrip(".")) for m in SECTION.finditer(text)]
        count += len(cites)
        bad += [f"{rel}:{line}: §{n}" for line, n in cites if n not in known]
    assert count > 50, "expected the code to cite docs/architecture.md"
    assert not bad, "citations of sections docs/architecture.md does not have:\n" + "\n".join(bad)


def test_no_citation_of_the_old_spec_remains():
    hits = [f"{rel}:{i}: {line.strip()[:160]}"
            for rel, text in repo_text_files().items() if rel not in PLANTED
            for i, line in enumerate(text.splitlines(), 1) if OLD_SPEC.search(line)]
    assert not hits, "old spec citations (cite docs/architecture.md §N.M instead):\n" + "\n".join(hits)


@pytest.mark.parametrize("text, want", [
    ("(docs/architecture.md §1.5.3)", ["1.5.3"]),
    ("see docs/architecture.md §5.2, §5.3, §5.4.", ["5.2", "5.3", "5.4"]),
    ("(docs/architecture.md §3.1/§3.2): x", ["3.1", "3.2"]),
    ("docs/architecture.md §4.2-§4.3", ["4.2", "4.3"]),
    ("[notes](architecture.md) §2 and DESIGN §9", ["2"]),
    ("DESIGN §3.2 only", []),
])
def test_citation_parser(text, want):
    assert [n for _, n in cited_sections(text)] == want
