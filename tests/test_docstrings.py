"""Every module of engine/, operator/ and pkg/ opens with a docstring of at most 10 lines.

A module's docstring says what it owns, what it must never do and why (STYLE.md); the
detail belongs next to the code it describes or in docs/, the figures in
docs/performance.md and bench/results/. Read with `ast` (nothing is imported); the
generated protobuf modules (*_pb2*) are not ours to write.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "operator", "pkg")
MAX_LINES = 10


def docstring_lines(source: str) -> int:
    """Lines of a module's docstring as Python cleans it (0 when it has none)."""
    doc = ast.get_docstring(ast.parse(source), clean=True)
    return len(doc.splitlines()) if doc else 0


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name)


def test_module_docstrings_are_at_most_ten_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in modules()
            if (n := docstring_lines(p.read_text())) > MAX_LINES]
    assert not long, (f"module docstrings over {MAX_LINES} lines (keep what the module owns and "
                      "must never do; move the rest next to its code or to docs/):\n" + "\n".join(long))


def test_the_count_is_the_docstrings_lines():
    assert docstring_lines('"""One line."""\nx = 1\n') == 1
    assert docstring_lines('"""First.\n\n    Third.\n    """\n') == 3
    assert docstring_lines("x = 1\n") == 0
    assert docstring_lines('"""' + "\n".join(["l"] * 11) + '\n"""\n') == 11


def test_the_walk_sees_every_package():
    seen = {p.relative_to(ROOT).parts[0] for p in modules()}
    assert seen == set(PACKAGES)
    assert not any("_pb2" in p.name for p in modules())
