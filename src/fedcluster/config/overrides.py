"""Command-line changes to a config: algorithm selection, per-algorithm ``--set``, sweeps, names.

- ``--algorithms ifca,jgl`` keeps the preset's entries (and so their
  parameters) for algorithms the preset has, matched by label or name, and
  adds default entries for the others (:func:`select_algorithms`).
- ``--set algorithms.ifca.n_clusters=3``: an algorithm is addressed by label
  or name as well as by index; a key that is not ``name``, ``label`` or
  ``params`` is a parameter (:func:`expand_algorithm_key`).
- ``--sweep algorithms.jgl.lam=0.1,0.2,0.5`` (repeatable) replaces the entry
  by one entry per combination of the swept values, each labelled with its
  values, e.g. ``jgl(lam=0.1)``, all in the same run (:func:`apply_sweeps`); a
  sweep of any other field runs once per value (:mod:`fedcluster.sweeps`).
- :func:`run_slug` names a run directory after what the command line changed,
  so runs of one preset with different ``--set`` do not share a name.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
import re
from typing import Any

import yaml

from fedcluster.config import safeyaml
from fedcluster.errors import ConfigError

_ENTRY_KEYS = ("name", "label", "params")


def _entries(raw: dict[str, Any]) -> list[dict[str, Any]]:
    algorithms = raw.get("algorithms")
    if algorithms is None:
        return [{"name": "fedavg"}]  # the schema's default
    if not isinstance(algorithms, list) or not all(isinstance(a, dict) for a in algorithms):
        raise ConfigError("field 'algorithms': expected a list of {name, label, params}")
    return algorithms


def _matches(raw: dict[str, Any], selector: str) -> list[int]:
    """Indices of the entries labelled ``selector``, else of those named ``selector``."""
    entries = _entries(raw)
    found = [i for i, a in enumerate(entries) if a.get("label") == selector]
    return found or [i for i, a in enumerate(entries) if a.get("name") == selector]


def select_algorithms(raw: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The config with only ``names``' entries (the config's own, else defaults), in that order."""
    out = copy.deepcopy(raw)
    entries = _entries(raw)
    chosen = []
    for name in names:
        found = _matches(raw, name)
        chosen += [copy.deepcopy(entries[i]) for i in found] or [{"name": name}]
    out["algorithms"] = chosen
    return out


def expand_algorithm_key(raw: dict[str, Any], key: str) -> list[str]:
    """``algorithms.<label or name>.<param>`` as index keys ``algorithms.<i>.params.<param>``.

    Other keys are returned unchanged.
    """
    parts = key.strip().split(".")
    if len(parts) < 2 or parts[0] != "algorithms" or parts[1].isdigit():
        return [key]
    found = _matches(raw, parts[1])
    if not found:
        have = ", ".join(a.get("label") or str(a.get("name")) for a in _entries(raw))
        raise ConfigError(
            f"--set {key}: no algorithm labelled or named {parts[1]!r} (have: {have})"
        )
    rest = parts[2:]
    if rest and rest[0] not in _ENTRY_KEYS:
        rest = ["params", *rest]
    return [".".join(["algorithms", str(i), *rest]) for i in found]


def parse_sweep(text: str) -> tuple[str, str, list[Any]]:
    """``algorithms.<sel>.<param>=v1,v2,...`` -> (selector, param, values)."""
    key, sep, values = text.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 3 or parts[0] != "algorithms" or not values.strip():
        raise ConfigError(
            f"--sweep {text!r}: only algorithms.<algorithm>.<parameter>=v1,v2,... sweeps "
            "within one run; other fields run once per value (fedcluster.sweep)"
        )
    return parts[1], parts[2], parse_values(key, values)


def parse_values(key: str, text: str) -> list[Any]:
    """``v1,v2,...`` of ``--sweep key=...`` parsed as YAML; commas inside brackets or
    braces belong to a value (``[8,8],[16]`` is two values)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [safeyaml.loads(v, f"--sweep {key}: value {v[:80]!r}") for v in items]


def value_text(v: Any) -> str:
    """``v`` as YAML flow text (what ``--set`` and ``--sweep`` parse back to ``v``)."""
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


MAX_ENTRIES = 10_000
"""The most algorithm entries a sweep may expand to (each is a job per seed), counted
before any combination is built."""


def apply_sweeps(raw: dict[str, Any], sweeps: list[str]) -> dict[str, Any]:
    """Replace each swept entry by one labelled entry per combination of its swept values."""
    if not sweeps:
        return raw
    out = copy.deepcopy(raw)
    entries = _entries(out)
    per_entry: dict[int, list[tuple[str, list[Any]]]] = {}
    for text in sweeps:
        selector, param, values = parse_sweep(text)
        found = _matches(out, selector)
        if not found:
            have = ", ".join(a.get("label") or str(a.get("name")) for a in entries)
            raise ConfigError(
                f"--sweep {text}: no algorithm labelled or named {selector!r} "
                f"(have: {have}; add it with --algorithms)"
            )
        for i in found:
            per_entry.setdefault(i, []).append((param, values))
    total = len(entries) - len(per_entry)
    for i in per_entry:
        total += math.prod(len(v) for _, v in per_entry[i])
    if total > MAX_ENTRIES:
        raise ConfigError(
            f"--sweep: {total:,} algorithm entries (every combination of the swept values); "
            f"at most {MAX_ENTRIES:,} in a run"
        )
    expanded = []
    for i, entry in enumerate(entries):
        if i not in per_entry:
            expanded.append(entry)
            continue
        params = [p for p, _ in per_entry[i]]
        base = entry.get("label") or entry["name"]
        for combo in itertools.product(*(v for _, v in per_entry[i])):
            chosen = dict(zip(params, combo, strict=True))
            inner = ",".join(f"{p}={value_text(v)}" for p, v in chosen.items())
            expanded.append(
                {
                    **entry,
                    "label": f"{base}({inner})",
                    "params": {**(entry.get("params") or {}), **chosen},
                }
            )
    out["algorithms"] = expanded
    return out


def run_slug(
    sets: list[str], algorithms: str | None = None, sweeps: list[str] | None = None, limit: int = 60
) -> str:
    """A short name for what the command line changed ('' when nothing): readable or a hash."""
    parts = [s.split("=", 1)[0].split(".")[-1] + "=" + s.partition("=")[2] for s in sets]
    if algorithms:
        parts.append(algorithms.replace(",", "+"))
    parts += [f"sweep-{s.split('=', 1)[0].split('.')[-1]}" for s in sweeps or []]
    if not parts:
        return ""
    slug = re.sub(r"[\[\]{}'\" ]", "", "_".join(parts)).replace(",", "+")
    slug = re.sub(r"[^A-Za-z0-9_.=+-]+", "-", slug).strip("-")
    if len(slug) <= limit:
        return slug
    text = "\n".join([*sets, algorithms or "", *(sweeps or [])])
    return hashlib.sha1(text.encode()).hexdigest()[:8]
