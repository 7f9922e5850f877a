"""No function in the package is longer than 60 lines of code (its docstring aside):
a longer one is split by meaning into functions that each do one thing."""

from __future__ import annotations

import ast
from pathlib import Path

import fedcluster

LIMIT = 60
PACKAGE = Path(fedcluster.__file__).parent


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's last line, less its docstring's."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if docstring and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_function_is_longer_than_60_lines():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = _code_lines(node)
                if lines > LIMIT:
                    found[f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"] = lines
    assert not found, f"functions over {LIMIT} lines of code: {found}"


def test_code_lines_leave_out_the_docstring():
    tree = ast.parse('def f():\n    """One\n    two."""\n    x = 1\n    return x\n')
    assert _code_lines(tree.body[0]) == 3
