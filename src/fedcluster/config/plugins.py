"""Plugins: algorithms, partitions and datasets defined outside fedcluster.

Wherever the config names an algorithm (``algorithms: [{name: ...}]``,
``--algorithms``), a partition (``data.partition.name``) or a dataset
(``data.dataset``), the name is looked up in this order:

1. a built-in name (``ifca``, ``dirichlet``, ``mnist``, ...);
2. an import path ``package.module:attribute`` (as models already accept):
   the module is imported and the attribute is the plugin;
3. an installed plugin: an entry point of the group ``fedcluster.algorithms``,
   ``fedcluster.partitions`` or ``fedcluster.datasets`` (the convention of
   pytest's and Flower's plugins, read with :mod:`importlib.metadata`), e.g. in
   a package's ``pyproject.toml``::

       [project.entry-points."fedcluster.algorithms"]
       mymethod = "mypkg.cfl:MyMethod"

A name that is both built in and installed, or installed twice, is an error
naming both, never a silent overwrite. Plugin code is imported only for the
names a config (or ``fedcluster list``) asks for, and only by
:func:`import_object`: the one function that imports user code, so that a
guard (e.g. on a resumed run directory's import paths) has one place to go.

This module imports no torch: :mod:`fedcluster.config.schema` may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from importlib import metadata
from typing import Any, Literal

from fedcluster.errors import ConfigError

Kind = Literal["algorithm", "partition", "dataset", "model", "federation", "loss"]
GROUPS: dict[str, str] = {
    "algorithm": "fedcluster.algorithms",
    "partition": "fedcluster.partitions",
    "dataset": "fedcluster.datasets",
}
"""Entry-point group of each kind of installed plugin."""


def is_import_path(name: str) -> bool:
    """Whether ``name`` is a ``package.module:attribute`` path rather than a registered name."""
    return ":" in name


def import_object(path: str, kind: Kind) -> Any:
    """The object at ``package.module:attribute`` (the attribute may be dotted, e.g.
    ``mod:Class.factory``); a :class:`ConfigError` in one line when it cannot be imported,
    also when the module's own code raises while it is imported (naming what it raised).

    The one place where fedcluster imports code named by a user or an installed plugin.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{kind} {path!r}: an import path is 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{kind} {path!r} cannot be imported: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- the module's own code raised while importing
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ConfigError(f"{kind} {path!r} cannot be imported: it raised {detail}") from None
    return obj


def installed(kind: Kind) -> dict[str, str]:
    """Installed plugins of ``kind``: entry-point name -> import path (nothing is imported).

    Raises:
        ConfigError: two installed distributions declare the same name.
    """
    found: dict[str, tuple[str, str]] = {}
    for ep in metadata.entry_points(group=GROUPS[kind]):
        dist = ep.dist.name if ep.dist is not None else "?"
        if ep.name in found and found[ep.name][0] != ep.value:
            raise ConfigError(
                f"{kind} plugin {ep.name!r} is installed twice: {found[ep.name][1]} "
                f"({found[ep.name][0]}) and {dist} ({ep.value}); uninstall one"
            )
        found[ep.name] = (ep.value, dist)
    return {name: value for name, (value, _) in found.items()}


def check_no_clash(kind: Kind, builtin: Iterable[str]) -> None:
    """A :class:`ConfigError` when an installed plugin takes a built-in name."""
    clash = sorted(set(installed(kind)) & set(builtin))
    if clash:
        raise ConfigError(
            f"installed {kind} plugin(s) {clash} take built-in names; a duplicate name is "
            f"an error: rename the entry point(s) in group {GROUPS[kind]!r}"
        )


def resolve(kind: Kind, name: str, builtin: dict[str, Any]) -> Any:
    """The plugin called ``name``: built in, an import path, or installed (module docstring).

    Raises:
        ConfigError: unknown name (listing the built-in and installed ones), a
            duplicate name, or an import path that cannot be imported.
    """
    if is_import_path(name):
        return import_object(name, kind)
    plugins = installed(kind)
    if name in builtin:
        if name in plugins:
            check_no_clash(kind, builtin)
        return builtin[name]
    if name in plugins:
        return import_object(plugins[name], kind)
    allowed = ", ".join([*sorted(builtin), *sorted(plugins)])
    raise ConfigError(f"unknown {kind} {name!r}; allowed: {allowed}, or 'package.module:attribute'")
