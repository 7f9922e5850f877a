"""Property-based checks of bad input (hypothesis): random config mutations, corrupt data files.

Whatever the input, ``fedcluster run`` ends with exit code 0 or 2 (a one-line
error), never an uncaught exception, and a run that fails before training
leaves no run directory (a run that fails later leaves a consistent one: the
config and the tables' headers). Examples are few and tiny (4 clients, one
round) so the whole file runs in well under a minute.
"""

from __future__ import annotations

import copy
import gzip
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcluster.cli import main
from fedcluster.config.schema import resolve_config
from fedcluster.errors import ConfigError

TINY: dict[str, Any] = {
    "name": "fuzz",
    "seeds": [0],
    "rounds": 1,
    "data": {
        "dataset": "digits",
        "partition": {"name": "iid", "n_clients": 4, "test_fraction": 0.2},
    },
    "model": {"name": "mlp", "options": {"hidden": [8]}},
    "train": {"lr": 0.1, "batch_size": 16, "epochs": 1},
    "participation": {"fraction": 0.5},
    "scenario": {"faulty": {"share": 0.25}},
    "aggregation": {"rule": "median"},
    "algorithms": [{"name": "fedavg"}, {"name": "ifca", "params": {"n_clusters": 2}}],
}

# Values a mutation writes. Run length is bounded by the CLI's --rounds 1; epochs and
# steps keep small values (a huge but valid count would only make the example slow).
VALUES = st.one_of(
    st.none(),
    st.sampled_from([-1, 0, 1, 2, 3, 10**12, 0.5, -0.5, 1e300, "x", "unknown", [], {}, True]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-3, 3), max_size=3),
)
SLOW_KEYS = {("train", "epochs"), ("train", "steps")}
NO_NETWORK = ("data", "download")


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested dict/list config."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        out.append((*prefix, key))
        if isinstance(value, dict | list):
            out += _paths(value, (*prefix, key))
    return out


@st.composite
def mutated_configs(draw: st.DrawFn) -> dict:
    raw = copy.deepcopy(TINY)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(raw)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = raw
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["delete", "set", "unknown-key"]))
        if op == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif op == "unknown-key" and isinstance(parent, dict):
            parent["zzz_" + draw(st.text("abc", min_size=1, max_size=3))] = 1
        elif tuple(path) not in SLOW_KEYS and tuple(path) != NO_NETWORK:
            value = draw(VALUES)
            if tuple(path) in SLOW_KEYS and isinstance(value, int) and value > 3:
                value = 3
            parent[path[-1]] = value
    if isinstance(raw.get("data"), dict):
        raw["data"]["download"] = False  # never the network
    return raw


def _run(config_text: str, extra: list[str]) -> tuple[int, Path]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.yaml"
        cfg.write_text(config_text)
        out = Path(tmp) / "run"
        code = main(["run", str(cfg), "--quiet", "--rounds", "1", "--out", str(out), *extra])
        assert code in (0, 2)
        if out.exists():
            names = {p.name for p in out.iterdir()}
            assert {"config.yaml", "metrics.csv"} <= names  # a consistent run directory
            if code == 0:
                assert (out / "summary.json").is_file()
        elif code == 0:
            raise AssertionError("a successful run wrote no run directory")
        return code, out


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(raw=mutated_configs())
def test_mutated_configs_exit_0_or_2(raw, capsys):
    _run(yaml.safe_dump(raw, sort_keys=False), [])
    err = capsys.readouterr().err
    assert "Traceback" not in err


def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(n).to_bytes(4, "big") for n in array.shape
    )
    return header + array.astype(np.uint8).tobytes()


def _mnist_dir(root: Path, corrupt: tuple[str, int, int] | None) -> None:
    """A tiny MNIST-shaped data root (40 training, 10 test images); one file maybe corrupted."""
    rng = np.random.default_rng(0)
    folder = root / "mnist"
    folder.mkdir(parents=True)
    for split, n in (("train", 40), ("t10k", 10)):
        files = {
            f"{split}-images-idx3-ubyte.gz": _idx(rng.integers(0, 256, size=(n, 28, 28))),
            f"{split}-labels-idx1-ubyte.gz": _idx(np.arange(n) % 10),
        }
        for name, data in files.items():
            blob = gzip.compress(data)
            if corrupt is not None and corrupt[0] == name:
                _, how, where = corrupt
                cut = where % len(blob)
                if how == 0:  # truncated
                    blob = blob[:cut]
                elif how == 1:  # garbled byte
                    blob = blob[:cut] + bytes([blob[cut] ^ 0xFF]) + blob[cut + 1 :]
                else:  # a valid gzip of a garbled IDX payload
                    raw = bytearray(data)
                    raw[where % len(raw)] ^= 0xFF
                    blob = gzip.compress(bytes(raw))
            (folder / name).write_bytes(blob)


FILES = [
    f"{s}-{k}-idx{d}-ubyte.gz" for s in ("train", "t10k") for k, d in (("images", 3), ("labels", 1))
]


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(name=st.sampled_from(FILES), how=st.integers(0, 2), where=st.integers(0, 10**6))
def test_corrupt_idx_files_exit_0_or_2(name, how, where, capsys):
    with tempfile.TemporaryDirectory() as data:
        _mnist_dir(Path(data), (name, how, where))
        raw = copy.deepcopy(TINY)
        raw["data"] = {
            "dataset": "mnist",
            "data_dir": data,
            "partition": {"name": "iid", "n_clients": 2},
        }
        code, _ = _run(yaml.safe_dump(raw), [])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if how == 0:  # a truncated gzip stream loses its CRC trailer: always an error
        assert code == 2
    if code == 2:  # the one-line error names the broken file
        assert name in err.strip().splitlines()[-1]


def test_the_tiny_config_itself_runs(capsys):
    code, _ = _run(yaml.safe_dump(TINY), [])
    assert code == 0


# Texts a --set value can be: scalars of every type, YAML aliases, deep nesting.
SET_TEXTS = st.one_of(
    st.sampled_from(["true", "'7'", "1e300", "-1", ".nan", "&a [*a, *a]", "[" * 5000 + "]" * 5000]),
    st.integers(-(10**40), 10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)
SET_KEYS = [
    "rounds",
    "seeds",
    "train.lr",
    "train.batch_size",
    "name",
    "model.options.hidden",
    "privacy.epsilon",
    "scenario.drift",
    "data.partition.n_clients",
    "group_size",
]


@settings(max_examples=30, deadline=2000)  # never a hang: each example within 2 s
@given(key=st.sampled_from(SET_KEYS), text=SET_TEXTS)
def test_set_values_are_a_valid_config_or_one_config_error(key, text):
    try:
        config = resolve_config(None, None, [f"{key}={text}"])
    except ConfigError as exc:
        assert "\n" not in str(exc) or str(exc).startswith("invalid config:")
    else:  # accepted: the values are the strict types the schema declares
        assert type(config.rounds) is int and all(type(s) is int and s >= 0 for s in config.seeds)
        assert isinstance(config.train.lr, float) and 0 < config.train.lr <= 1000
