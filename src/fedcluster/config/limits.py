"""Bounds and checks at the input boundary that the schema's field types cannot express.

- Strict scalars: pydantic's lax mode reads ``rounds: true`` as 1 round and a
  drift label ``'7'`` as 7; :func:`check_scalar_types` refuses a boolean or a
  string where the schema wants a number (:class:`fedcluster.config.schema._Strict`).
- Numeric bounds: the largest values the float32 computation carries
  (:data:`MAX_LR`, :data:`MAX_SCALE`, ...), used by the schema's fields.
- Names and paths: a run name is one path component (``name: ../../x`` wrote
  two levels above the working directory), labels and paths fit the file
  system's limits (255 bytes per component, 4096 per path: ``ENAMETOOLONG``
  otherwise, deep inside the run).
- Cross-field checks: a drift round after the last round would never happen.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

from fedcluster.errors import ConfigError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fedcluster.config.schema import ExperimentConfig

FIELD = "@"
"""Starts a message whose field (up to ':') extends the error's location (describe_error)."""

MAX_LR = 1e3
"""Largest learning rate: one SGD step of lr × a unit gradient stays far inside float32."""
MAX_COUNT = 10_000_000
"""Largest batch size, epoch or step count, group size."""
MAX_EPSILON = 1e6
"""Largest privacy budget ε (beyond it the accountant's search has no meaning)."""
MIN_SCALE, MAX_SCALE = 1e-12, 1e12
"""Bounds of a clipping norm: its square and its noise stay finite in float32 sums."""
MAX_SEED = 2**63 - 1
"""Seeds are non-negative and fit the 63-bit derived seeds (:mod:`fedcluster.rng`)."""
MAX_NAME = 100
"""Longest run name or algorithm label (they become file names with a suffix)."""
MAX_COMPONENT = 255
"""Longest file name in bytes (Linux ``NAME_MAX``)."""
MAX_PATH = 4000
"""Longest path in bytes (under Linux's ``PATH_MAX`` of 4096)."""


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a (possibly ``Annotated`` or union) type annotation."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [m for a in get_args(annotation) for m in _members(a)]
    return [annotation]


def _accepts(member: Any, kind: type) -> bool:
    if member is kind or member is Any:
        return True
    return get_origin(member) is Literal and any(type(a) is kind for a in get_args(member))


def wrong_scalar(value: Any, annotation: Any, where: str) -> str | None:
    """Why ``value`` does not fit ``annotation`` strictly (a bool or str for a number), or None."""
    members = _members(annotation)
    if any(m is Any for m in members):
        return None
    if isinstance(value, bool | str):
        if any(_accepts(m, type(value)) for m in members):
            return None
        if any(m in (int, float) for m in members):
            return f"{FIELD}{where}: expected a number, got {value!r}"
        return None
    for m in members:
        origin, args = get_origin(m), [a for a in get_args(m) if a is not Ellipsis]
        if isinstance(value, list | tuple) and origin in (list, tuple) and args:
            for i, item in enumerate(value):
                found = wrong_scalar(item, args[min(i, len(args) - 1)], f"{where}.{i}")
                if found:
                    return found
        if isinstance(value, dict) and origin is dict:
            for key, item in value.items():
                # JSON (and so a run's config.yaml) writes integer keys as text: '3'
                numeric_key = isinstance(key, str) and key.lstrip("-").isdigit()
                found = (
                    None if numeric_key else wrong_scalar(key, args[0], f"{where}.{key}")
                ) or wrong_scalar(item, args[1], f"{where}.{key}")
                if found:
                    return found
    return None


def check_scalar_types(model: type[BaseModel], data: dict[str, Any]) -> None:
    """Raise ``ValueError`` (pydantic reports it with the section) on a coerced scalar."""
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is not None:
            problem = wrong_scalar(value, field.annotation, key)
            if problem:
                raise ValueError(problem)


def check_path(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` if every component and the whole fit the file system's limits."""
    text = os.fsencode(path)
    if b"\0" in text:
        raise ConfigError(f"{what}: the path contains a NUL byte")
    if len(text) > MAX_PATH:
        raise ConfigError(f"{what}: path of {len(text)} bytes, more than {MAX_PATH}")
    for part in text.split(b"/"):
        if len(part) > MAX_COMPONENT:
            shown = part[:40].decode(errors="replace")
            raise ConfigError(
                f"{what}: file name {shown!r}... has {len(part)} bytes, more than {MAX_COMPONENT}"
            )
    return Path(path)


def check_names(config: ExperimentConfig) -> None:
    """The run name is one safe path component; labels and ``data_dir`` fit the file system."""
    name = config.name
    if (
        not name
        or len(name) > MAX_NAME
        or name in (".", "..")
        or any(ch in name for ch in "/\\\0")
        or name.startswith("-")
    ):
        raise ValueError(
            f"name {name[:40]!r}: give 1 to {MAX_NAME} characters without '/', '\\\\' or a "
            "leading '-', not '.' or '..' (the run directory is named after it)"
        )
    for spec in config.algorithms:
        label = spec.display_name()
        if len(label) > MAX_NAME:
            raise ValueError(
                f"algorithms: label {label[:40]!r}... has {len(label)} characters, more than "
                f"{MAX_NAME} (it names the checkpoint file); give a shorter label"
            )
    if config.data.data_dir is not None:
        check_path(config.data.data_dir, "data.data_dir")


def check_rounds(config: ExperimentConfig) -> None:
    """Scheduled rounds lie within the run: a drift at round 999 of 3 would never happen."""
    for i, drift in enumerate(config.scenario.drift):
        late = [r for r in drift.rounds if r > config.rounds]
        if late:
            raise ValueError(
                f"scenario.drift.{i}.rounds: {late} after the last round {config.rounds} "
                "would never happen"
            )
