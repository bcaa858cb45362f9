"""Files and functions stay small enough to read whole. Files are cut by concept: about 300 lines is where to ask
whether a file holds two concepts, never a reason to cut one in two, so this test only flags the real outliers, a
file of the library or the benchmarks over 450 lines; no function over 60 (decorators and docstrings included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("paratrain", "benchmarks")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_file_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}, f"split these files (lines): {long}"


def test_no_function_over_60_lines():
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if (n := node.end_lineno - first + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert long == {}, f"split these functions (lines): {long}"
