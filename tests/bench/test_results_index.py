"""bench/results/ keeps the runs that back a claim, each listed in its INDEX.md: a results
file without an entry, an entry naming a missing file, or a results file that README.md or
docs/*.md cite but the folder lacks, fails here (issue 22: the folder had grown to 279
files, many of them exploratory, and a cited run could vanish unnoticed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "INDEX.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A results file's name: <bench>-<YYYYMMDD>-<machine and label>.<ext>; a `*` is a glob.
RESULT_NAME = re.compile(r"(?<![\w-])([a-z][a-z0-9]*-\d{8}-[\w.*-]*?\.(?:md|json|png|log))(?!\w)")


def indexed_files(index_text: str) -> set[str]:
    """The file names the index's `files:` lines list."""
    names: set[str] = set()
    for line in index_text.splitlines():
        if line.startswith("files:"):
            names |= set(re.findall(r"`([^`]+)`", line))
    return names


def missing_citations(doc_text: str, present: set[str]) -> list[str]:
    """The results files `doc_text` names that are not in `present` (a glob must match one)."""
    missing = []
    for name in RESULT_NAME.findall(doc_text):
        if "*" in name:
            rx = re.compile("^" + re.escape(name).replace(r"\*", ".*") + "$")
            if not any(rx.match(p) for p in present):
                missing.append(name)
        elif name not in present:
            missing.append(name)
    return missing


def _present() -> set[str]:
    return {p.name for p in RESULTS.iterdir() if p.is_file() and p.name != INDEX.name}


def test_every_results_file_has_an_index_entry() -> None:
    unlisted = sorted(_present() - indexed_files(INDEX.read_text()))
    assert not unlisted, (f"bench/results files without an entry in bench/results/INDEX.md: {unlisted}; "
                          "add each under the claim it backs (where it is made), or git rm it")


def test_every_index_entry_names_a_file_that_is_there() -> None:
    stale = sorted(indexed_files(INDEX.read_text()) - _present())
    assert not stale, f"bench/results/INDEX.md lists files that are not in bench/results: {stale}"


def test_every_results_file_the_docs_cite_is_there() -> None:
    present = _present()
    missing = {str(d.relative_to(ROOT)): m for d in DOCS if (m := missing_citations(d.read_text(), present))}
    assert not missing, f"results files cited but missing from bench/results: {missing}"


def test_the_checks_catch_an_unlisted_file_and_a_missing_citation() -> None:
    index = "## step-20991231-h200\n\nfiles: `step-20991231-h200.json`, `step-20991231-h200.md`\n"
    assert indexed_files(index) == {"step-20991231-h200.json", "step-20991231-h200.md"}
    present = {"step-20991231-h200.json", "step-20991231-h200.md", "capacity-20991231-h200x2-a.md"}
    assert present - indexed_files(index) == {"capacity-20991231-h200x2-a.md"}
    text = ("measured in `step-20991231-h200.md`, and in bench/results/step-20991231-h200-gone.json; "
            "the runs capacity-20991231-h200x2-*.md and transfer-20991231-h200x2-*.md")
    assert missing_citations(text, present) == ["step-20991231-h200-gone.json", "transfer-20991231-h200x2-*.md"]
