"""The bundled benchmark suites (``<name>.yaml``), run by ``fedcluster benchmark``
(:mod:`fedcluster.benchmark`).
"""

from __future__ import annotations

from importlib import resources


def list_suites() -> list[str]:
    """The built-in suites' names."""
    files = resources.files(__name__).iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".yaml"))
