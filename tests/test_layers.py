"""Layers point one way (docs/architecture.md): the config schema is a leaf, every
package imports only lower layers, and no module imports itself back."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path


def test_importing_the_config_loads_no_algorithm_and_no_engine():
    code = (
        "import sys, fedcluster.config.schema\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('fedcluster.algorithms', "
        "'fedcluster.engine', 'torch')))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""


def test_importing_fedcluster_changes_nothing_in_the_process():
    # no environment variable, no matplotlib backend, no pyplot on import
    code = (
        "import os, matplotlib\n"
        "matplotlib.use('svg')\n"
        "import fedcluster, fedcluster.reporting, fedcluster.reporting.figures, sys\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), matplotlib.get_backend(),\n"
        "      'matplotlib.pyplot' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "MPLBACKEND")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    assert out == ["None", "svg", "False"]


def test_python_m_fedcluster_runs_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "fedcluster", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("fedcluster ")


def test_top_level_names_are_lazy_and_complete():
    code = (
        "import sys, fedcluster\n"
        "loaded = 'torch' in sys.modules\n"
        "names = [n for n in fedcluster.__all__ if n != '__version__']\n"
        "assert sorted(names) == sorted(fedcluster._EXPORTS), 'update __all__'\n"
        "missing = [n for n in names if getattr(fedcluster, n, None) is None]\n"
        "print(loaded, missing, fedcluster.IFCA is sys.modules['fedcluster.algorithms.ifca']"
        ".IFCAParams)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "[]", "True"]


# ----------------------------------------------------------------------------- layer order
# Lowest first; a unit (a package, or a module at the top of fedcluster) imports only
# units of lower layers. Imports for type checking only (``if TYPE_CHECKING:``) are
# annotations, not dependencies, and are left out.
LAYERS: list[set[str]] = [
    {"errors", "rng", "openmp", "memory", "stats"},
    {"config"},
    {"data", "models", "clustering"},
    {"privacy"},
    {"protocol"},
    {"engine"},
    {"algorithms"},
    {"experiment"},
    {"reporting", "flower"},
    {"sweeps", "reproduce", "benchmark"},
    {"cli", "api", "__init__"},
    {"__main__"},
]
SRC = Path(__file__).resolve().parents[1] / "src" / "fedcluster"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _runtime_imports(path: Path) -> set[str]:
    """The fedcluster modules a module imports when it runs (lazy imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path.parent)
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fedcluster.")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if base != "fedcluster" and not base.startswith("fedcluster."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if _is_module(sub):
                    found.add(sub)
                elif base != "fedcluster":
                    found.add(base)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _runtime_imports(p) for p in sorted(SRC.rglob("*.py"))}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"fedcluster.{unit} is in no layer: place it in a package (LAYERS)")


def test_every_unit_imports_only_lower_layers():
    upward = sorted(
        f"{mod} imports {dep}"
        for mod, deps in _graph().items()
        for dep in deps
        if _unit(dep) != _unit(mod) and _layer(_unit(dep)) >= _layer(_unit(mod))
    )
    assert upward == []


def test_no_import_cycles():
    graph = _graph()
    done: set[str] = set()
    cycles = []

    def visit(mod: str, path: list[str]) -> None:
        if mod in path:
            cycles.append(" -> ".join(path[path.index(mod) :] + [mod]))
            return
        if mod in done:
            return
        for dep in sorted(graph.get(mod, ())):
            if dep != mod and not mod.startswith(dep + "."):  # a module's own package loads first
                visit(dep, [*path, mod])
        done.add(mod)

    for mod in graph:
        visit(mod, [])
    assert cycles == []


def test_module_names_are_unique():
    names: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.stem, []).append(_module_name(path))
    for path in SRC.rglob("__init__.py"):
        if path.parent != SRC:
            names.setdefault(path.parent.name, []).append(_module_name(path))
    assert {n: m for n, m in names.items() if len(m) > 1} == {}


def test_every_package_says_what_lives_there():
    for init in SRC.rglob("__init__.py"):
        if init.parent == SRC:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc, f"{init}: no docstring"
