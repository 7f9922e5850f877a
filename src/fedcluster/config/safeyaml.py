"""YAML and JSON read with limits: size, nesting depth and expanded size.

PyYAML's ``safe_load`` runs no code, but a 50,000-deep ``[[[...]]]`` exhausts
the composer's recursion (``RecursionError``), and an anchor bomb -- ten
aliases of ten aliases of ... -- loads as a small graph of shared references
that every later deep copy, validation or dump expands to billions of nodes
(the probe: 480 s, then out of memory). Here a document is refused, with one
:class:`~fedcluster.errors.ConfigError` line naming the source, when it is

- larger than :data:`MAX_BYTES` or not a regular file (``/dev/zero``, a FIFO),
- nested deeper than :data:`MAX_DEPTH` (counted while composing, before the
  recursion could overflow),
- more than :data:`MAX_NODES` values once every alias is expanded (counted
  with an early stop, so a bomb fails in microseconds).

Numbers written without a dot (``1e-3``) are floats, as in YAML 1.2 and JSON.

A config is a few hundred values nested a few levels deep; the limits are
orders of magnitude above any real one.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from fedcluster.errors import ConfigError

MAX_BYTES = 1 << 20
"""Largest config document read (1 MiB)."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists."""
MAX_NODES = 100_000
"""Most values in a document with every alias expanded."""


class _LimitedLoader(yaml.SafeLoader):
    """``SafeLoader`` that stops composing past :data:`MAX_DEPTH` levels."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _TooDeep(Exception):
    pass


# YAML 1.1 reads `1e-3` (no dot) as a string, which the schema used to coerce; read it
# as the float it means, so that numbers given as strings can be refused
_LimitedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def count_nodes(value: Any, limit: int = MAX_NODES) -> int:
    """The number of values in ``value`` with shared references counted every time
    they occur (what a deep copy builds), stopping once it passes ``limit``."""
    seen = 0
    stack = [value]
    while stack and seen <= limit:
        node = stack.pop()
        seen += 1
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return seen


def check_size(value: Any, source: str) -> Any:
    """``value`` itself, or a :class:`ConfigError` if it expands past :data:`MAX_NODES`."""
    if count_nodes(value) > MAX_NODES:
        raise ConfigError(
            f"{source}: more than {MAX_NODES:,} values once its aliases are expanded "
            "(an alias bomb?)"
        )
    return value


def loads(text: str, source: str) -> Any:
    """Parse YAML (or JSON) text within the limits; errors name ``source``."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{source} is larger than {MAX_BYTES:,} bytes")
    try:
        loader = _LimitedLoader(text)  # the reader refuses control characters here
        try:
            value = loader.get_single_data()
        finally:
            loader.dispose()
    except _TooDeep:
        raise ConfigError(f"{source} is nested deeper than {MAX_DEPTH} levels") from None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{source} is not valid YAML: {detail}") from None
    return check_size(value, source)


def read_text(path: Path, what: str, limit: int = MAX_BYTES) -> str:
    """A small regular text file's content; one-line :class:`ConfigError` otherwise."""
    try:
        # O_NONBLOCK: opening a FIFO would wait for a writer; a regular file ignores it
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(f"{what} {path} is not a regular file")
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory, not a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {path} is larger than {limit:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc}") from None


def load_file(path: Path, what: str = "config file") -> Any:
    """Read and parse a YAML file within the limits."""
    return loads(read_text(path, what), f"{what} {path}")
