"""A family of bad inputs and faults against the CLI (docs/reliability.md).

Each case runs ``fedcluster`` (:func:`fedcluster.cli.main`) in a forked child
with its own working directory, stdout/stderr captured and a time limit, and is
classified:

- ``error``: exit 2 with exactly one ``fedcluster: error:`` line, no traceback;
- ``ok``: exit 0 and the case's consistency check holds (outputs as expected);
- ``traceback``: an uncaught exception (or any other exit code);
- ``hang``: still running after the limit (killed);
- ``silently wrong``: exit 0 where an error was due, or a failed consistency check.

Families: config fields × bad values, named config and CLI cases, IDX and LEAF
data files, run-directory tampering and resume, ``report`` on malformed run
directories, ``verify``, races of two runs on one ``--out``, and a full disk
(a real tmpfs of a few hundred KiB when it can be mounted, else ``ENOSPC``
injected into the run directory's writes).

    PYTHONPATH=src:. nice python -m benchmarks.robustness.bad_inputs --out runs/bad-inputs
"""

from __future__ import annotations

import argparse
import errno
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcluster.cli import main as cli_main

TINY = [
    "--quiet",
    "--no-report",
    "--set",
    "data.dataset=digits",
    "--set",
    "data.partition={name: iid, n_clients: 4, test_fraction: 0.2}",
    "--set",
    "model.options.hidden=[8]",
    "--set",
    "algorithms=[{name: fedavg}]",
    "--set",
    "rounds=4",
    "--set",
    "checkpoint_every=2",
]
LIMIT_S = 120.0

FIELDS = [
    "rounds",
    "seeds",
    "train.lr",
    "train.batch_size",
    "train.epochs",
    "train.steps",
    "train.momentum",
    "privacy.epsilon",
    "privacy.delta",
    "privacy.clip",
    "participation.fraction",
    "participation.count",
    "eval_every",
    "checkpoint_every",
    "group_size",
    "scenario.availability",
    "scenario.failure_rate",
    "scenario.faulty.share",
    "aggregation.trim",
    "aggregation.clip_quantile",
    "rejection.norm_factor",
    "rejection.max_norm",
    "deployment.min_replies",
    "deployment.round_timeout",
]
BAD_VALUES = ["true", "false", "'7'", ".nan", ".inf", "-1", "[]", "{x: 1}"]

Check = Callable[[Path], bool]


@dataclass
class Case:
    """One bad input: ``run(dir)`` returns the exit code; ``expect`` is error, ok, exit 1
    or interrupted (exit 130 with one line, then ``check``)."""

    name: str
    family: str
    run: Callable[[Path], int]
    expect: str = "error"
    check: Check | None = None
    limit: float = LIMIT_S
    check_on_error: bool = False
    """Also check the outputs after a clean error (a victim file intact, a first run whole)."""


def cli(*argv: str) -> Callable[[Path], int]:
    return lambda d: cli_main(list(argv))


def run_args(*extra: str, out: str = "run") -> Callable[[Path], int]:
    return cli("run", *TINY, "--out", out, *extra)


def written(path: str, text: str | bytes, then: Callable[[Path], int]) -> Callable[[Path], int]:
    def go(d: Path) -> int:
        p = d / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return then(d)

    return go


def finished(d: Path, out: str = "run") -> bool:
    """A complete run directory: summary.json and 4 rounds of metrics, all finite accuracies."""
    run = d / out
    if not (run / "summary.json").is_file():
        return False
    lines = (run / "metrics.csv").read_text().splitlines()
    return len(lines) == 5


# --------------------------------------------------------------------------- families


def config_field_cases() -> list[Case]:
    cases = []
    for key in FIELDS:
        for value in BAD_VALUES:
            text = f"[{value}]" if key == "seeds" else value
            cases.append(Case(f"{key}={value}", "config field", run_args("--set", f"{key}={text}")))
    return cases


def _bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\nname: *a{levels - 1}\n"


def named_config_cases() -> list[Case]:
    deep_yaml = "x: " + "[" * 50_000 + "]" * 50_000 + "\n"
    deep_json = '{"x": ' + "[" * 50_000 + "]" * 50_000 + "}"
    rot = "data.partition={name: rotation, base: iid, base_options: {n_clients: 8}, n_groups: 100}"
    specs: list[tuple[str, Callable[[Path], int]]] = [
        ("lr 1e300", run_args("--set", "train.lr=1e300")),
        ("lr 1.0e+300", run_args("--set", "train.lr=1.0e+300")),
        ("hidden [0]", run_args("--set", "model.options.hidden=[0]")),
        ("hidden [-1]", run_args("--set", "model.options.hidden=[-1]")),
        ("hidden ['x']", run_args("--set", "model.options.hidden=[x]")),
        ("hidden 1e12", run_args("--set", "model.options.hidden=[1000000000000]")),
        ("client DP eps 1e-12", run_args("--set", "privacy={mode: client, epsilon: 1.0e-12}")),
        ("record DP eps 1e-9", run_args("--set", "privacy={mode: record, epsilon: 1.0e-9}")),
        (
            "rounds: true (file)",
            written("c.yaml", "rounds: true\n", cli("run", "c.yaml", "--quiet", "--out", "run")),
        ),
        ("n_clients 1500 of digits", run_args("--set", "data.partition.n_clients=1500")),
        ("n_groups 100 of 8 clients", run_args("--set", rot)),
        (
            "drift round 999 of 4",
            run_args("--set", "scenario.drift=[{kind: rotate, rounds: [999]}]"),
        ),
        (
            "drift labels '7'",
            run_args(
                "--set", "scenario.drift=[{kind: swap_labels, rounds: [2], labels: ['7', 1]}]"
            ),
        ),
        (
            "drift labels true",
            run_args(
                "--set", "scenario.drift=[{kind: swap_labels, rounds: [2], labels: [true, 1]}]"
            ),
        ),
        ("name ../../x", run_args("--set", "name=../../x")),
        ("name with a slash", run_args("--set", "name=a/b")),
        ("name 300 chars", run_args("--set", "name=" + "n" * 300)),
        (
            "label 300 chars",
            run_args("--set", "algorithms=[{name: fedavg, label: " + "l" * 300 + "}]"),
        ),
        ("data_dir component 300", run_args("--set", "data.data_dir=" + "d" * 300)),
        ("data_dir 5000 bytes", run_args("--set", "data.data_dir=" + "/dd" * 1700)),
        ("seeds [-1]", run_args("--set", "seeds=[-1]")),
        ("--seed -1", run_args("--seed", "-1")),
        ("compare --algorithms ''", cli("compare", *TINY, "--out", "run", "--algorithms", "")),
        ("compare --algorithms ','", cli("compare", *TINY, "--out", "run", "--algorithms", ",")),
        (
            "compare --seeds 0",
            cli("compare", *TINY, "--out", "run", "--algorithms", "fedavg", "--seeds", "0"),
        ),
        ("anchor bomb config", written("c.yaml", _bomb(), run_args("c.yaml"))),
        (
            "anchor bomb --set",
            run_args("--set", "x=" + _bomb().replace("\n", ", ").rstrip(", ").join("{}")),
        ),
        ("anchor bomb --sweep", run_args("--sweep", "algorithms.fedavg.mu=&a [*a]")),
        ("nested 50,000 YAML", written("c.yaml", deep_yaml, run_args("c.yaml"))),
        ("nested 50,000 JSON", written("c.json", deep_json, run_args("c.json"))),
        ("nested 50,000 --set", run_args("--set", "x=" + "[" * 50_000 + "]" * 50_000)),
        ("config /dev/zero", run_args("/dev/zero")),
        ("config 2 MB", written("c.yaml", "# " + "x" * 2_000_000 + "\n", run_args("c.yaml"))),
        ("config a directory", lambda d: (d / "cdir").mkdir() or run_args("cdir")(d)),
        ("config empty", written("c.yaml", "\n", run_args("c.yaml"))),
        ("config binary", written("c.yaml", bytes(range(256)), run_args("c.yaml"))),
        ("config a list", written("c.yaml", "- 1\n- 2\n", run_args("c.yaml"))),
        (
            "config !!python tag",
            written("c.yaml", "name: !!python/object/apply:os.system [id]\n", run_args("c.yaml")),
        ),
        ("config missing", run_args("nope.yaml")),
        ("config with a control character", written("c.yaml", "a: \x90\n", run_args("c.yaml"))),
        ("--set with a control character", run_args("--set", "train.lr=\x90")),
        ("--out /proc/version/x", cli("run", *TINY, "--out", "/proc/version/x")),
        ("--out /proc/x", cli("run", *TINY, "--out", "/proc/fedcluster-x")),
        ("--out under a file", written("f", "x", cli("run", *TINY, "--out", "f/run"))),
        ("--out is a file", written("f", "x", cli("run", *TINY, "--out", "f"))),
        ("--out 5000 bytes", cli("run", *TINY, "--out", "o" * 5000)),
        ("--out component 300", cli("run", *TINY, "--out", "o" * 300)),
        ("--tensorboard at a file", written("tb", "x", run_args("--tensorboard", "tb"))),
        ("--tensorboard in /proc", run_args("--tensorboard", "/proc/version/tb")),
        ("epsilon .inf", run_args("--set", "privacy={mode: client, epsilon: .inf}")),
        ("model too large", run_args("--set", "model.options.hidden=[1000000, 1000000]")),
        ("unknown model", run_args("--set", "model.name=nope")),
        ("model import fails", run_args("--set", "model.name=no_such_module:x")),
        ("rounds 1e12", run_args("--rounds", "1000000000000")),
        (
            "participation.count 1e30",
            run_args("--set", "participation.count=1000000000000000000000000000000"),
        ),
        ("unknown key", run_args("--set", "zzz=1")),
        ("unknown preset", cli("run", "--preset", "nope", "--out", "run")),
        ("unknown algorithm", run_args("--set", "algorithms=[{name: nope}]")),
        ("--set without =", run_args("--set", "rounds")),
        ("--set bad YAML", run_args("--set", "rounds=[")),
        ("bad_clients unknown", run_args("--set", "data.bad_clients=maybe")),
        ("unknown dataset", run_args("--set", "data.dataset=nope")),
        ("show unknown preset", cli("show", "nope")),
    ]
    return [Case(n, "config/CLI", f) for n, f in specs]


def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(n).to_bytes(4, "big") for n in array.shape
    )
    return header + array.astype(np.uint8).tobytes()


MNIST = [
    f"{s}-{k}-idx{d}-ubyte" for s in ("train", "t10k") for k, d in (("images", 3), ("labels", 1))
]


def _mnist_root(d: Path) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    raw = {}
    for split, n in (("train", 80), ("t10k", 20)):
        raw[f"{split}-images-idx3-ubyte"] = _idx(rng.integers(0, 256, size=(n, 28, 28)))
        raw[f"{split}-labels-idx1-ubyte"] = _idx(np.arange(n) % 10)
    folder = d / "data" / "mnist"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in raw.items():
        (folder / f"{name}.gz").write_bytes(gzip.compress(data))
    return raw


MNIST_RUN = ("--set", "data={dataset: mnist, data_dir: data, partition: {name: iid, n_clients: 4}}")


def idx_case(
    name: str,
    change: Callable[[Path, dict[str, bytes]], None],
    expect: str = "error",
    check: Check | None = None,
) -> Case:
    def go(d: Path) -> int:
        raw = _mnist_root(d)
        change(d / "data" / "mnist", raw)
        return run_args(*MNIST_RUN)(d)

    return Case(name, "data: IDX", go, expect, check)


def data_cases() -> list[Case]:
    cases = []
    for fname in MNIST:
        for how in ("truncated", "garbled byte", "garbled payload"):
            for where in (10, 200, 5000):

                def change(f: Path, raw: dict, fname=fname, how=how, where=where) -> None:
                    p = f / f"{fname}.gz"
                    blob = p.read_bytes()
                    cut = where % len(blob)
                    if how == "truncated":
                        blob = blob[:cut]
                    elif how == "garbled byte":
                        blob = blob[:cut] + bytes([blob[cut] ^ 0xFF]) + blob[cut + 1 :]
                    else:
                        data = bytearray(raw[fname])
                        data[where % len(data)] ^= 0xFF
                        blob = gzip.compress(bytes(data))
                    p.write_bytes(blob)

                expect = "error" if how == "truncated" else "either"
                cases.append(idx_case(f"{fname} {how} @{where}", change, expect, _ran))

    def bomb(f: Path, raw: dict) -> None:  # a valid header, then 300 MB of zeros
        z = __import__("zlib").compressobj(1, wbits=31)
        data = raw["train-images-idx3-ubyte"]
        blob = z.compress(data) + b"".join(z.compress(bytes(1 << 20)) for _ in range(300))
        (f / "train-images-idx3-ubyte.gz").write_bytes(blob + z.flush())

    def huge_header(f: Path, raw: dict) -> None:
        header = bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (60000, 4096, 4096))
        (f / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(header))

    def twin(f: Path, raw: dict) -> None:  # every label 0, uncompressed, beside the .gz
        n = len(raw["train-labels-idx1-ubyte"]) - 8
        (f / "train-labels-idx1-ubyte").write_bytes(raw["train-labels-idx1-ubyte"][:8] + bytes(n))

    def labels_out_of_range(f: Path, raw: dict) -> None:
        data = bytearray(raw["train-labels-idx1-ubyte"])
        data[8] = 200
        (f / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(data)))

    def loop(f: Path, raw: dict) -> None:
        (f / "train-labels-idx1-ubyte.gz").unlink()
        (f / "train-labels-idx1-ubyte.gz").symlink_to(f / "train-labels-idx1-ubyte.gz")

    def devzero(f: Path, raw: dict) -> None:
        (f / "train-images-idx3-ubyte.gz").unlink()
        (f / "train-images-idx3-ubyte.gz").symlink_to("/dev/zero")

    def directory(f: Path, raw: dict) -> None:
        (f / "train-images-idx3-ubyte.gz").unlink()
        (f / "train-images-idx3-ubyte.gz").mkdir()

    cases += [
        idx_case("gzip bomb (300 MB of trailing zeros)", bomb),
        idx_case("IDX header declaring 1 TB", huge_header),
        idx_case("uncompressed all-zero twin of the labels", twin, "ok", _not_all_zero_labels),
        idx_case("labels out of range", labels_out_of_range),
        idx_case("label file a symlink loop", loop),
        idx_case("image file -> /dev/zero", devzero),
        idx_case("image file a directory", directory),
    ]
    return cases + leaf_cases()


def _ran(d: Path) -> bool:
    return finished(d)


def _not_all_zero_labels(d: Path) -> bool:
    """The twin (all labels 0) was not read: accuracy is not the trivial 1.0."""
    if not finished(d):
        return False
    summary = json.loads((d / "run" / "summary.json").read_text())
    return all(
        j["final_accuracy"] is not None and j["final_accuracy"] < 0.99 for j in summary["jobs"]
    )


def _leaf_root(d: Path, edit: Callable[[str, dict], None] | None = None, users: int = 6) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("test", 4)):
        names = [f"u{i}" for i in range(users)]
        data = {
            u: {"x": rng.random((n, 784)).round(2).tolist(), "y": [i % 10 for i in range(n)]}
            for u in names
        }
        doc = {"users": names, "num_samples": [n] * users, "user_data": data}
        if edit is not None:
            edit(split, doc)
        folder = d / "leaf" / "femnist" / split
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "all.json").write_text(json.dumps(doc))


LEAF_RUN = ("--set", "data={dataset: leaf-femnist, data_dir: leaf, partition: {name: natural}}")


def leaf_case(
    name: str, edit, expect: str = "error", check: Check | None = None, extra: tuple = ()
) -> Case:
    def go(d: Path) -> int:
        _leaf_root(d, edit)
        return run_args(*LEAF_RUN, *extra)(d)

    return Case(name, "data: LEAF", go, expect, check)


def _excluded(*clients: int) -> Check:
    """The run finished, the bad clients were named in the log, the others' rows are finite."""

    def check(d: Path) -> bool:
        if not finished(d):
            return False
        err = (d / "stderr").read_text()
        named = all(f"client {c}:" in err for c in clients) and "excluded" in err
        rows = (d / "run" / "metrics.csv").read_text().splitlines()[1:]
        return named and all(r.split(",")[3] not in ("", "nan") for r in rows)

    return check


def leaf_cases() -> list[Case]:
    def user(i: int, key: str, fn) -> Callable[[str, dict], None]:
        def edit(split: str, doc: dict) -> None:
            if split == "train":
                rec = doc["user_data"][f"u{i}"]
                rec[key] = fn(rec[key])

        return edit

    def nan_pixel(x):
        x[0][300] = float("nan")
        return x

    def huge(x):
        return [[1e30] * 784 for _ in x]

    def empty(split: str, doc: dict) -> None:
        doc["user_data"]["u2"] = {"x": [], "y": []}
        doc["num_samples"][2] = 0

    def test_only(split: str, doc: dict) -> None:
        if split == "test":
            doc["users"].append("ghost")
            doc["num_samples"].append(1)
            doc["user_data"]["ghost"] = {"x": [[0.0] * 784], "y": [1]}

    def deep(split: str, doc: dict) -> None:
        doc["extra"] = json.loads("[" * 900 + "]" * 900)

    cases = [
        leaf_case("LEAF NaN pixel in one user", user(3, "x", nan_pixel), "ok", _excluded(3)),
        leaf_case("LEAF pixels 1e30 in one user", user(1, "x", huge), "ok", _excluded(1)),
        leaf_case("LEAF user with 0 samples", empty, "ok", _excluded(2)),
        leaf_case(
            "LEAF user with 0 samples, refuse", empty, extra=("--set", "data.bad_clients=refuse")
        ),
        leaf_case(
            "LEAF NaN pixel, refuse",
            user(3, "x", nan_pixel),
            extra=("--set", "data.bad_clients=refuse"),
        ),
        leaf_case("LEAF label 99", user(0, "y", lambda y: [99] + y[1:])),
        leaf_case("LEAF label -1", user(0, "y", lambda y: [-1] + y[1:])),
        leaf_case("LEAF label '7'", user(0, "y", lambda y: ["7"] + y[1:])),
        leaf_case("LEAF label true", user(0, "y", lambda y: [True] + y[1:])),
        leaf_case("LEAF label 2.5", user(0, "y", lambda y: [2.5] + y[1:])),
        leaf_case("LEAF x short row", user(0, "x", lambda x: [x[0][:10]] + x[1:])),
        leaf_case("LEAF x text", user(0, "x", lambda x: ["abc"] + x[1:])),
        leaf_case("LEAF x/y lengths differ", user(0, "y", lambda y: y[:-1])),
        leaf_case("LEAF user only in test", test_only),
        leaf_case("LEAF deeply nested extra key (ok)", deep, "ok", _ran),
    ]

    def not_json(d: Path) -> int:
        _leaf_root(d)
        (d / "leaf/femnist/train/all.json").write_text("{nope")
        return run_args(*LEAF_RUN)(d)

    def deep_file(d: Path) -> int:
        _leaf_root(d)
        (d / "leaf/femnist/train/all.json").write_text("[" * 100_000 + "]" * 100_000)
        return run_args(*LEAF_RUN)(d)

    def no_users(d: Path) -> int:
        _leaf_root(d)
        (d / "leaf/femnist/train/all.json").write_text('{"users": [], "user_data": {}}')
        return run_args(*LEAF_RUN)(d)

    def num_samples(d: Path) -> int:
        _leaf_root(d, lambda s, doc: doc["num_samples"].__setitem__(0, 999))
        return run_args(*LEAF_RUN)(d)

    cases += [
        Case("LEAF file not JSON", "data: LEAF", not_json),
        Case("LEAF file nested 100,000 deep", "data: LEAF", deep_file),
        Case("LEAF no users", "data: LEAF", no_users),
        Case("LEAF num_samples wrong", "data: LEAF", num_samples),
    ]
    return cases


# --------------------------------------------------------------------------- run directories

_TEMPLATE: dict[str, Path] = {}


def stopped_run(d: Path) -> Path:
    """A copy of a run stopped after round 2 of 4 (made once per benchmark)."""
    shutil.copytree(_TEMPLATE["stopped"], d / "run", symlinks=True)
    return d / "run"


def _resume(*extra: str) -> Callable[[Path], int]:
    return cli("resume", "--quiet", "--no-report", *extra, "run")


def _complete_and_equal(d: Path) -> bool:
    """Resumed to the end with the uninterrupted run's metrics (timing columns aside)."""
    return finished(d) and _table(d / "run") == _table(_TEMPLATE["full"])


def _table(run: Path) -> list[list[str]]:
    rows = [line.split(",") for line in (run / "metrics.csv").read_text().splitlines()]
    drop = {i for i, c in enumerate(rows[0]) if c.endswith("_seconds")}
    return [[v for i, v in enumerate(r) if i not in drop] for r in rows]


def tamper(
    name: str,
    edit: Callable[[Path], None],
    expect: str = "error",
    check: Check | None = None,
    *extra: str,
) -> Case:
    def go(d: Path) -> int:
        run = stopped_run(d)
        edit(run)
        return _resume(*extra)(d)

    return Case(name, "run directory", go, expect, check, check_on_error=expect == "error")


def _meta(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        import torch

        path = run / "checkpoints" / "fedavg-seed0.pt"
        raw = torch.load(path, weights_only=True)
        meta = json.loads(raw["meta"])
        change(meta)
        raw["meta"] = json.dumps(meta)
        torch.save(raw, path)

    return edit


def _config_edit(old: str, new: str) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        text = (run / "config.yaml").read_text()
        (run / "config.yaml").write_text(text.replace(old, new, 1))

    return edit


def _symlink(entry: str, to: str = "victim") -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        (run.parent / "victim").write_text("precious\n")
        (run / entry).unlink(missing_ok=True)
        (run / entry).symlink_to(run.parent / to if to == "victim" else to)

    return edit


def _victim_intact(d: Path) -> bool:
    return (d / "victim").read_text() == "precious\n"


def rundir_cases() -> list[Case]:
    def setitem(key, value):
        return lambda m: m.__setitem__(key, value)

    def forged_row(m: dict) -> None:
        m["rows"].append({**m["rows"][-1], "round": 3, "accuracy": 1.0})

    def shifted_rows(m: dict) -> None:
        m["rows"][0]["round"] = 2

    def other_label(m: dict) -> None:
        m["rows"][0]["algorithm"] = "ifca"

    def write(name: str, data: bytes) -> Callable[[Path], None]:
        return lambda run: (run / name).write_bytes(data)

    def pickle_exploit(run: Path) -> None:
        import pickle

        class Exploit:
            def __reduce__(self):
                return (os.system, (f"touch {run.parent / 'victim'}",))

        (run / "checkpoints/fedavg-seed0.pt").write_bytes(pickle.dumps({"meta": Exploit()}))

    def no_victim(d: Path) -> bool:
        return not (d / "victim").exists()

    cases = [
        tamper("checkpoint round -5", _meta(setitem("round", -5))),
        tamper("checkpoint round 1e9", _meta(setitem("round", 10**9))),
        tamper("checkpoint round 2.5", _meta(setitem("round", 2.5))),
        tamper("checkpoint round '2'", _meta(setitem("round", "2"))),
        tamper("checkpoint forged row", _meta(forged_row)),
        tamper("checkpoint shifted rows", _meta(shifted_rows)),
        tamper("checkpoint rows of another job", _meta(other_label)),
        tamper("checkpoint rows not a list", _meta(setitem("rows", {"a": 1}))),
        tamper("checkpoint events beyond its round", _meta(setitem("events", [[9, 0, "x", ""]]))),
        tamper("checkpoint wall_seconds -1", _meta(setitem("wall_seconds", -1))),
        tamper("checkpoint digest removed", _meta(lambda m: m.pop("config_sha256"))),
        tamper("checkpoint format 2", _meta(setitem("format", 2))),
        tamper("checkpoint meta a list", _meta(lambda m: m.clear())),
        tamper(
            "checkpoint truncated",
            lambda run: (run / "checkpoints/fedavg-seed0.pt").write_bytes(
                (run / "checkpoints/fedavg-seed0.pt").read_bytes()[:300]
            ),
        ),
        tamper("checkpoint empty", write("checkpoints/fedavg-seed0.pt", b"")),
        tamper("checkpoint pickle exploit", pickle_exploit, "error", no_victim),
        tamper("checkpoint a symlink", _symlink("checkpoints/fedavg-seed0.pt", "/dev/zero")),
        tamper("config.yaml lr edited", _config_edit("lr: 0.1", "lr: 0.5")),
        tamper("config.yaml rounds edited", _config_edit("rounds: 4", "rounds: 6")),
        tamper("config.yaml model.name 'this:x'", _config_edit("name: mlp", "name: this:x")),
        tamper("config.yaml anchor bomb", write("config.yaml", _bomb().encode())),
        tamper("config.yaml garbage", write("config.yaml", bytes(range(256)))),
        tamper("config.yaml -> /dev/zero", _symlink("config.yaml", "/dev/zero")),
        tamper("config.yaml removed", lambda run: (run / "config.yaml").unlink()),
        tamper("symlink .lock", _symlink(".lock"), "error", _victim_intact),
        tamper("symlink metrics.csv.tmp", _symlink("metrics.csv.tmp"), "error", _victim_intact),
        tamper("symlink summary.json.tmp", _symlink("summary.json.tmp"), "error", _victim_intact),
        tamper(
            "symlink fedavg-seed0.pt.tmp",
            _symlink("checkpoints/fedavg-seed0.pt.tmp"),
            "error",
            _victim_intact,
        ),
        tamper("symlink metrics.csv", _symlink("metrics.csv"), "error", _victim_intact),
        tamper("symlink events.csv", _symlink("events.csv"), "error", _victim_intact),
        tamper(
            "metrics.csv deleted (repaired)",
            lambda run: (run / "metrics.csv").unlink(),
            "ok",
            _complete_and_equal,
        ),
        tamper(
            "metrics.csv garbage rows (repaired)",
            write("metrics.csv", b"round,x\n\xff\xfe,1\n"),
            "ok",
            _complete_and_equal,
        ),
        tamper(
            "stale .pt.tmp (ok)",
            write("checkpoints/fedavg-seed0.pt.tmp", b"stale"),
            "ok",
            _complete_and_equal,
        ),
        tamper(
            "metrics.csv a directory",
            lambda run: ((run / "metrics.csv").unlink(), (run / "metrics.csv").mkdir()),
        ),
        tamper("untampered resume (ok)", lambda run: None, "ok", _complete_and_equal),
        Case("resume of a file", "run directory", written("run", "x", _resume())),
        Case(
            "resume of an empty directory",
            "run directory",
            lambda d: (d / "run").mkdir() or _resume()(d),
        ),
        Case("resume of a missing directory", "run directory", _resume()),
    ]
    return cases


def report_cases() -> list[Case]:
    def broken(edit: Callable[[Path], None]) -> Callable[[Path], int]:
        def go(d: Path) -> int:
            shutil.copytree(_TEMPLATE["full"], d / "run", symlinks=True)
            edit(d / "run")
            return cli_main(["report", "run"])

        return go

    def write(name: str, text: str | bytes) -> Callable[[Path], None]:
        data = text if isinstance(text, bytes) else text.encode()
        return lambda run: (run / name).write_bytes(data)

    def cut_column(run: Path) -> None:
        lines = (run / "metrics.csv").read_text().splitlines()
        (run / "metrics.csv").write_text("\n".join(line.rsplit(",", 3)[0] for line in lines))

    edits = {
        "no metrics.csv": lambda run: (run / "metrics.csv").unlink(),
        "metrics header only": write("metrics.csv", "round,algorithm,seed\n"),
        "metrics garbage row": lambda run: (run / "metrics.csv").write_text(
            (run / "metrics.csv").read_text() + "x,y\n"
        ),
        "metrics seed not a number": lambda run: (run / "metrics.csv").write_text(
            (run / "metrics.csv").read_text().replace(",fedavg,0,", ",fedavg,zero,")
        ),
        "metrics columns cut": cut_column,
        "metrics binary": write("metrics.csv", bytes(range(256))),
        "config.yaml a list": write("config.yaml", "- 1\n"),
        "config.yaml binary": write("config.yaml", bytes(range(256))),
        "config.yaml anchor bomb": write("config.yaml", _bomb()),
        "summary.json invalid": write("summary.json", "{nope"),
        "summary.json nested 100,000": write("summary.json", "[" * 100_000 + "]" * 100_000),
        "clusters.csv garbage": write("clusters.csv", "algorithm,seed\nfedavg,x\n"),
        "diagnostics.csv garbage": write(
            "diagnostics.csv", "algorithm,seed,round,name,value\nfedavg,0,x,y,z\n"
        ),
        "events.csv binary": write("events.csv", bytes(range(256))),
    }
    tolerated = {  # the report is made without what is missing: fine either way
        "clusters.csv garbage",
        "diagnostics.csv garbage",
        "events.csv binary",
        "metrics columns cut",
    }

    def has_report(d: Path) -> bool:
        return (d / "run" / "report.html").is_file()

    cases = [
        Case(
            f"report: {n}", "report", broken(e), "either" if n in tolerated else "error", has_report
        )
        for n, e in edits.items()
    ]
    cases += [
        Case(
            "report --out at a file",
            "report",
            lambda d: (
                shutil.copytree(_TEMPLATE["full"], d / "run"),
                (d / "f").write_text("x"),
                cli_main(["report", "run", "--out", "f"]),
            )[-1],
        ),
        Case("report of a missing directory", "report", cli("report", "nope")),
        Case("report of two runs without --out", "report", cli("report", "a", "b")),
        Case(
            "report (ok)",
            "report",
            lambda d: (shutil.copytree(_TEMPLATE["full"], d / "run"), cli_main(["report", "run"]))[
                -1
            ],
            "ok",
            lambda d: (d / "run/report.html").is_file(),
        ),
    ]
    return cases


def verify_cases() -> list[Case]:
    def root(d: Path) -> Path:
        shutil.copytree(Path(os.environ["FEDCLUSTER_DATA"]) / "mnist", d / "data" / "mnist")
        return d / "data" / "mnist"

    def twin(d: Path) -> int:
        f = root(d)
        (f / "train-labels-idx1-ubyte").write_bytes(
            bytes([0, 0, 8, 1]) + (60000).to_bytes(4, "big") + bytes(60000)
        )
        (f / "train-labels-idx1-ubyte.gz").unlink()
        return cli_main(["verify", "--data-dir", "data"])

    def missing(d: Path) -> int:
        (root(d) / "t10k-images-idx3-ubyte.gz").unlink()
        return cli_main(["verify", "--data-dir", "data"])

    def loop(d: Path) -> int:
        f = root(d)
        (f / "train-labels-idx1-ubyte.gz").unlink()
        (f / "train-labels-idx1-ubyte.gz").symlink_to(f / "train-labels-idx1-ubyte.gz")
        return cli_main(["verify", "--data-dir", "data"])

    def fails_naming(word: str) -> Check:
        return lambda d: word in (d / "stdout").read_text()

    return [
        Case(
            "verify: unpinned uncompressed twin", "verify", twin, "exit 1", fails_naming("unpinned")
        ),
        Case("verify: missing file", "verify", missing, "exit 1", fails_naming("missing")),
        Case("verify: symlink loop", "verify", loop, "exit 1", fails_naming("unreadable")),
        Case(
            "verify: data dir a file", "verify", written("f", "x", cli("verify", "--data-dir", "f"))
        ),
    ]


# --------------------------------------------------------------------------- races, disk full


def race_cases() -> list[Case]:
    def during(d: Path) -> int:
        code = (
            "import time\nfrom fedcluster.experiment.callbacks import Callback\n"
            "from fedcluster.cli import main\nimport fedcluster.experiment.rundir as r\n"
            "class Slow(Callback):\n"
            "    def on_round_end(self, job, rnd, row, state):\n"
            "        if rnd == 1: open('started', 'w').close(); time.sleep(2)\n"
            "orig = r.run_directory_callbacks\n"
            "r.run_directory_callbacks = lambda *a: orig(*a) + [Slow()]\n"
            "import fedcluster.experiment.runner as R\n"
            "R.run_directory_callbacks = r.run_directory_callbacks\n"
            f"raise SystemExit(main(['run', *{TINY!r}, '--out', 'run']))\n"
        )
        first = subprocess.Popen([sys.executable, "-c", code], cwd=d, stderr=subprocess.DEVNULL)
        while not (d / "started").exists() and first.poll() is None:
            time.sleep(0.05)
        second = cli_main(["run", *TINY, "--out", "run"])
        (d / "first.rc").write_text(str(first.wait()))
        return second

    def first_intact(d: Path) -> bool:
        return (d / "first.rc").read_text() == "0" and finished(d)

    def after(d: Path) -> int:
        shutil.copytree(_TEMPLATE["full"], d / "run")
        return cli_main(["run", *TINY, "--out", "run"])

    def untouched(d: Path) -> bool:
        return _table(d / "run") == _table(_TEMPLATE["full"])

    def together(d: Path) -> int:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "fedcluster.cli", "run", *TINY, "--out", "run"],
                cwd=d,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        codes = sorted(p.wait() for p in procs)
        errs = [p.stderr.read() for p in procs if p.stderr]
        (d / "codes").write_text(json.dumps(codes))
        if any("Traceback" in e for e in errs):
            return 1
        if codes == [0, 0]:  # the later one found run taken and wrote run-2
            return 0 if finished(d) and beside(d) else 1
        if codes == [0, 2]:  # both claimed run at once: one refused in one line
            print("fedcluster: error: one of two simultaneous runs refused", file=sys.stderr)
            return 2
        return 1

    def beside(d: Path) -> bool:  # the second run wrote run-2, not into the first
        return (d / "run-2" / "summary.json").is_file()

    return [
        Case(
            "race: second run during the first (writes run-2)",
            "race",
            during,
            "ok",
            lambda d: first_intact(d) and beside(d),
        ),
        Case(
            "race: second run after the first (writes run-2)",
            "race",
            after,
            "ok",
            lambda d: untouched(d) and beside(d),
        ),
        Case(
            "race: two runs started together",
            "race",
            together,
            "either",
            finished,
            check_on_error=True,
        ),
    ]


def disk_full_cases(mount: bool) -> list[Case]:
    """Runs whose --out is on a tiny tmpfs (really full), then resumed with room again."""
    cases = []
    for kib in (8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 96, 160):

        def go(d: Path, kib: int = kib) -> int:
            fs = d / "fs"
            fs.mkdir()
            if mount:
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(fs)], check=True
                )
            else:
                _inject_enospc(fs, kib * 1024)
            try:
                code = cli_main(["run", *TINY, "--out", str(fs / "run")])
                (d / "run.rc").write_text(str(code))
                sys.stderr.flush()  # what follows is the recovery's: not the case's output
                os.dup2(os.open(d / "recovery.err", os.O_WRONLY | os.O_CREAT, 0o644), 2)
                if mount:
                    subprocess.run(["mount", "-o", "remount,size=64m", str(fs)], check=True)
                else:
                    _inject_enospc(fs, None)
                if code == 2 and (fs / "run").exists():
                    code = cli_main(["resume", "--quiet", "--no-report", str(fs / "run")])
                elif code == 2:
                    code = cli_main(["run", *TINY, "--out", str(fs / "run")])
                if code == 0:
                    shutil.copytree(fs / "run", d / "run")
                first = int((d / "run.rc").read_text())
                return first if code == 0 else 1
            finally:
                if mount:
                    subprocess.run(["umount", str(fs)], check=False)

        def equal(d: Path) -> bool:
            return finished(d) and _table(d / "run") == _table(_TEMPLATE["full"])

        cases.append(
            Case(
                f"disk full at {kib} KiB, then resumed",
                "disk full",
                go,
                "either",
                equal,
                check_on_error=True,
            )
        )
    return cases


def _inject_enospc(under: Path, budget: int | None) -> None:
    """Without a tmpfs: writes of the run directory fail with ENOSPC past ``budget`` bytes."""
    from fedcluster.experiment import safefiles

    real = getattr(safefiles, "_real_write_all", safefiles._write_all)
    safefiles._real_write_all = real
    if budget is None:
        safefiles._write_all = real
        return
    used = [0]

    def write_all(fd: int, data: bytes) -> None:
        used[0] += len(data)
        if used[0] > budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    safefiles._write_all = write_all


# --------------------------------------------------------------------------- running


def _ends_with_the_error(err: str, first: str) -> bool:
    """``err`` ends with the error line ``first``, or with it followed only by its
    indented continuation lines (one bad field each: ``invalid config:`` naming several)."""
    tail = err.rstrip().split(first, 1)
    return len(tail) == 2 and all(
        line.startswith("  ") for line in tail[1].splitlines() if line.strip()
    )


def run_case(case: Case, where: Path) -> tuple[str, float, str]:
    """Fork, run the case in ``where``, classify. Returns (outcome, seconds, last stderr line)."""
    where.mkdir(parents=True)
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.chdir(where)
            os.setpgid(0, 0)
            for fd, name in ((1, "stdout"), (2, "stderr")):
                out = os.open(where / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(out, fd)
            code = case.run(where)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 -- what the benchmark counts as a traceback
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    deadline = t0 + case.limit
    status = None
    while time.perf_counter() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "hang", time.perf_counter() - t0, ""
    seconds = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status) if status is not None else 1
    err = (where / "stderr").read_text(errors="replace")
    last = err.strip().splitlines()[-1] if err.strip() else ""
    return classify(case, rc, err, where), seconds, last


def classify(case: Case, rc: int, err: str, where: Path) -> str:
    """The outcome of ``case`` that exited with ``rc`` and wrote ``err`` in ``where``."""
    errors = [line for line in err.splitlines() if line.startswith("fedcluster: error:")]
    if case.expect == "interrupted" and "Traceback" not in err:
        good = rc == 130 and case.check is not None and case.check(where)
        return "error" if good else "silently wrong"
    if "Traceback" in err or rc not in (0, 1, 2):
        return "traceback"
    if case.expect == "exit 1":
        good = rc == 1 and case.check is not None and case.check(where)
        return "error" if good else "silently wrong"
    if rc == 2 and len(errors) == 1 and _ends_with_the_error(err, errors[0]):
        if case.expect == "ok" or (
            case.check_on_error and case.check is not None and not case.check(where)
        ):
            return "silently wrong"
        return "error"
    if rc == 0:
        if case.expect == "error":
            return "silently wrong"
        ok = case.check is None or case.check(where)
        return "ok" if ok else "silently wrong"
    return "traceback"  # exit 1/2 without the one line


def all_cases(mount: bool) -> list[Case]:
    from benchmarks.robustness.user_code_family import new_family_cases  # it imports this module

    return [
        *config_field_cases(),
        *named_config_cases(),
        *data_cases(),
        *rundir_cases(),
        *report_cases(),
        *verify_cases(),
        *race_cases(),
        *disk_full_cases(mount),
        *new_family_cases(),
    ]


def _can_mount() -> bool:
    with tempfile.TemporaryDirectory() as d:
        probe = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d], capture_output=True
        )
        if probe.returncode == 0:
            subprocess.run(["umount", d], check=False)
        return probe.returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/bad-inputs")
    p.add_argument("--only", default="", help="run the cases whose name contains this")
    args = p.parse_args()
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import fedcluster.experiment.runner  # noqa: F401 -- imported once here, before the forks

    for name, stop in (("full", None), ("stopped", 2)):
        cmd = ["run", *TINY, "--out", str(out / name)]
        if stop is not None:
            from fedcluster.config.schema import resolve_config
            from fedcluster.experiment.runner import Experiment

            sets = [a for a in TINY[2:] if a != "--set"]
            Experiment(resolve_config(None, None, sets)).run(
                out / name, progress=False, stop_after_round=stop
            )
        else:
            assert cli_main(cmd) == 0
        _TEMPLATE[name] = out / name
    mount = _can_mount()
    cases = [c for c in all_cases(mount) if args.only in c.name]
    results = []
    for i, case in enumerate(cases):
        outcome, seconds, last = run_case(case, out / "cases" / f"{i:03d}")
        results.append(
            {
                "name": case.name,
                "family": case.family,
                "outcome": outcome,
                "seconds": round(seconds, 2),
                "last_line": last[:300],
            }
        )
        print(
            f"{i:3d} {outcome:15} {seconds:6.1f}s {case.family:14} {case.name}  | {last[:120]}",
            flush=True,
        )
    counts = Counter(r["outcome"] for r in results)
    by_family = {}
    for r in results:
        by_family.setdefault(r["family"], Counter())[r["outcome"]] += 1
    summary = {
        "cases": len(results),
        "counts": dict(counts),
        "by_family": {k: dict(v) for k, v in by_family.items()},
        "disk_full": "tmpfs" if mount else "injected ENOSPC",
        "results": results,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=1))


if __name__ == "__main__":
    main()
