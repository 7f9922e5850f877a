"""State in, state out: no algorithm module writes into a server state.

A round returns a new state (:class:`~fedcluster.algorithms.base.RoundOutput`);
the state it was given stays as it was. This reads every module of
``fedcluster.algorithms`` with :mod:`ast` and fails on any write through a name
``state``: an assignment to ``state.<x>`` or to an item or slice of it, a
``del``, ``setattr``/``object.__setattr__`` on it, or a mutating method called on
one of its fields (torch's in-place ``x_()`` methods, ``list.append``, ...).
The behaviour itself (the given state unchanged after a round) is tested for
every algorithm in ``test_rejection.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fedcluster.algorithms

PACKAGE = Path(fedcluster.algorithms.__file__).parent
MUTATORS = {
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
    "update",
    "setdefault",
    "popitem",
    "add",
    "discard",
    "fill",
    "put",
    "resize",
    "itemset",
    "setflags",
}
"""Methods of lists, dicts, sets and numpy arrays that change their object."""


def _on_state(node: ast.expr) -> bool:
    """Whether ``node`` is ``state.<x>``, or an item, slice or field of one."""
    while isinstance(node, ast.Subscript | ast.Attribute):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return node.value.id == "state"
        node = node.value
    return False


def _targets(node: ast.AST) -> list[ast.expr]:
    """What ``node`` assigns to or deletes, tuples unpacked."""
    if isinstance(node, ast.Assign | ast.Delete):
        found = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor):
        found = [node.target]
    elif isinstance(node, ast.With | ast.AsyncWith):
        found = [item.optional_vars for item in node.items if item.optional_vars is not None]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, ast.Tuple | ast.List):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def _is_state(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "state"


def state_writes(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every write into a ``state`` in ``source`` (module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hits = [t for t in _targets(node) if _on_state(t)]
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "setattr" and node.args:
                hits += [node.args[0]] if _is_state(node.args[0]) else []
            if isinstance(func, ast.Attribute) and func.attr == "__setattr__" and node.args:
                hits += [node.args[0]] if _is_state(node.args[0]) else []
            if isinstance(func, ast.Attribute) and _on_state(func.value):
                name = func.attr
                inplace = name.endswith("_") and not name.startswith("_")
                if inplace or name in MUTATORS:
                    hits.append(func)
        if hits:
            found.append((node.lineno, ast.unparse(hits[0])))
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_no_algorithm_module_writes_into_a_state(path: Path) -> None:
    writes = state_writes(path.read_text())
    assert not writes, f"{path.name} writes into a state: " + "; ".join(
        f"line {line}: {code}" for line, code in writes
    )


@pytest.mark.parametrize(
    "code",
    [
        "state.models = new",
        "state.assign[ex.clients] = choice",
        "state.models[:, cols], other = a, b",
        "state.reclusterings += 1",
        "del state.root",
        "setattr(state, 'models', new)",
        "object.__setattr__(state, 'models', new)",
        "state.models.copy_(new)",
        "state.models[0].add_(1.0)",
        "state.split_rounds.append(rnd)",
        "state.assign.fill(-1)",
        "for state.x in rows: pass",
    ],
)
def test_every_kind_of_write_is_found(code: str) -> None:
    assert [line for line, _ in state_writes(code)] == [1]


@pytest.mark.parametrize(
    "code",
    [
        "assign = state.assign.copy()",
        "new = replace(state, models=models)",
        "rows = state.models[labels]",
        "n = state.models.norm(dim=1)",
        "state = replace(state, assign=assign)",
        "other.models[0] = state.models[0]",
    ],
)
def test_reading_a_state_is_not_a_write(code: str) -> None:
    assert state_writes(code) == []
