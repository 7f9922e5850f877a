"""Bad inputs beyond files and fields: user code, the Python API, resources by
config, signals and forged node reports (docs/reliability.md).

Each family returns :class:`~benchmarks.robustness.bad_inputs.Case` objects that
:func:`~benchmarks.robustness.bad_inputs.run_case` classifies like the others.
A Python API call counts as clean when it raises fedcluster's own error (one
line, printed as the command would print it); a node's forged report counts as
clean when the server's check refuses it with one line; a signal counts as
clean when the command ends with ``fedcluster: interrupted`` (exit 130) and the
run directory then resumes to a complete run.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.robustness.bad_inputs import TINY, Case, cli, run_args
from fedcluster.cli import main as cli_main
from fedcluster.errors import FedclusterError

USER_MODULE = "userplug"
"""The module each user-code case writes into its own directory."""

_COMMON = """
import torch
from torch import nn


class Base(nn.Module):
    def __init__(self, input_shape=(64,), n_classes=10):
        super().__init__()
        self.fc = nn.Linear(int(torch.tensor(input_shape).prod()), n_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))


def base(input_shape, n_classes):
    return Base(input_shape, n_classes)
"""

USER_CODE: dict[str, tuple[str, str]] = {
    # name: (module body after _COMMON, the --set that uses it)
    "model returns NaN": (
        "class M(Base):\n    def forward(self, x):\n"
        "        return super().forward(x) * float('nan')\n"
        "def factory(s, k):\n    return M(s, k)\n",
        "model={name: userplug:factory}",
    ),
    "model returns a string": (
        "class M(Base):\n    def forward(self, x):\n        return 'logits'\n"
        "def factory(s, k):\n    return M(s, k)\n",
        "model={name: userplug:factory}",
    ),
    "model returns the wrong width": (
        "def factory(s, k):\n    return Base(s, k + 3)\n",
        "model={name: userplug:factory}",
    ),
    "model returns one row": (
        "class M(Base):\n    def forward(self, x):\n        return super().forward(x)[:1]\n"
        "def factory(s, k):\n    return M(s, k)\n",
        "model={name: userplug:factory}",
    ),
    "model factory raises": (
        "def factory(s, k):\n    raise RuntimeError('no GPU here')\n",
        "model={name: userplug:factory}",
    ),
    "model factory returns None": (
        "def factory(s, k):\n    return None\n",
        "model={name: userplug:factory}",
    ),
    "model with frozen layers": (
        "def factory(s, k):\n    m = Base(s, k)\n    m.fc.bias.requires_grad_(False)\n"
        "    return m\n",
        "model={name: userplug:factory}",
    ),
    "model with no parameters": (
        "class M(nn.Module):\n    def forward(self, x):\n"
        "        return torch.zeros(len(x), 10)\n"
        "def factory(s, k):\n    return M()\n",
        "model={name: userplug:factory}",
    ),
    "loss returns a string": (
        "def loss(logits, y):\n    return 'small'\n",
        "train.loss=userplug:loss",
    ),
    "loss returns NaN": (
        "def loss(logits, y):\n"
        "    return torch.nn.functional.cross_entropy(logits, y) * float('nan')\n",
        "train.loss=userplug:loss",
    ),
    "loss returns a vector": (
        "def loss(logits, y):\n"
        "    return torch.nn.functional.cross_entropy(logits, y, reduction='none')\n",
        "train.loss=userplug:loss",
    ),
    "loss raises": (
        "def loss(logits, y):\n    raise ValueError('bad day')\n",
        "train.loss=userplug:loss",
    ),
    "plugin module raises at import": (
        "raise ImportError('a dependency is missing')\n",
        "algorithms=[{name: userplug:Method}]",
    ),
    "plugin attribute missing": ("X = 1\n", "algorithms=[{name: userplug:Method}]"),
    "plugin module missing": ("", "algorithms=[{name: nosuchmodule:Method}]"),
    "plugin is not an algorithm": (
        "Method = 42\n",
        "algorithms=[{name: userplug:Method}]",
    ),
    "plugin algorithm is a function": (
        "def Method():\n    return 1\n",
        "algorithms=[{name: userplug:Method}]",
    ),
    "partition plugin returns None": (
        "def part(y_train, y_test, rng):\n    return None\n",
        "data.partition={name: userplug:part}",
    ),
    "partition plugin returns foreign indices": (
        "import numpy as np\n"
        "from fedcluster.data.partitions import Partition\n"
        "def part(y_train, y_test, rng):\n"
        "    n = len(y_train)\n"
        "    return Partition([np.arange(n, n + 5)] * 4, [np.arange(3)] * 4, 'test')\n",
        "data.partition={name: userplug:part}",
    ),
    "dataset plugin raises": (
        "def data(**options):\n    raise OSError('the share is down')\n",
        "data.dataset=userplug:data",
    ),
    "dataset plugin returns a string": (
        "def data(**options):\n    return 'mnist'\n",
        "data.dataset=userplug:data",
    ),
}


def _with_user_module(body: str, *argv: str) -> Callable[[Path], int]:
    """Write ``userplug.py`` (:data:`_COMMON` + ``body``) into the case's directory,
    put the directory on ``sys.path`` and run the command."""

    def go(d: Path) -> int:
        if body:
            (d / f"{USER_MODULE}.py").write_text(_COMMON + body)
        sys.path.insert(0, str(d))
        return cli_main(list(argv))

    return go


NON_FINITE = ("model returns NaN", "loss returns NaN")
"""Cases that run to the end: every upload is rejected by name, every cell is empty."""


def _non_finite_named(d: Path) -> bool:
    """Each metrics row has an empty accuracy and loss, and events.csv names each
    rejected upload as non-finite (never an accuracy of 0.0 passed off as a result)."""
    with open(d / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(d / "run" / "events.csv", newline="") as f:
        events = list(csv.DictReader(f))
    return (
        len(rows) == 4
        and all(r["accuracy"] == "" and r["test_loss"] == "" for r in rows)
        and bool(events)
        and all(e["kind"] == "rejected" and "non-finite" in e["detail"] for e in events)
    )


def user_code_cases() -> list[Case]:
    """Models, losses and plugins named by import path that break their contract."""
    cases = []
    for name, (body, setting) in USER_CODE.items():
        argv = ("run", *TINY, "--set", setting, "--out", "run")
        run = _with_user_module(body, *argv)
        if name in NON_FINITE:
            cases.append(Case(f"user code: {name}", "user code", run, "ok", _non_finite_named))
        else:
            cases.append(Case(f"user code: {name}", "user code", run))
    return cases


def _api(call: Callable[[Path], Any]) -> Callable[[Path], int]:
    """Run a Python API call; fedcluster's own error is the clean outcome (one line)."""

    def go(d: Path) -> int:
        try:
            call(d)
        except FedclusterError as exc:
            print(f"fedcluster: error: {exc}", file=sys.stderr)
            return 2
        return 0

    return go


def _federation(**change: Any) -> Any:
    import torch

    from fedcluster.data.federation import Federation

    g = torch.Generator().manual_seed(0)
    train = [(torch.randn(20, 8, generator=g), torch.randint(0, 3, (20,), generator=g))] * 4
    test = [(torch.randn(10, 8, generator=g), torch.randint(0, 3, (10,), generator=g))] * 4
    if "labels" in change:
        train = [(x, change["labels"](y)) for x, y in train]
    if change.get("empty_test"):
        test = [(x[:0], y[:0]) for x, y in test]
    return Federation.from_clients(train=train, test=test, n_classes=change.get("n_classes", 3))


def _small_run(d: Path, **kwargs: Any) -> Any:
    import fedcluster

    defaults: dict[str, Any] = {"model": "mlp", "rounds": 2, "out": d / "run", "report": False}
    return fedcluster.run(**{**defaults, **kwargs})


def api_cases() -> list[Case]:
    """The Python API called with what it cannot take."""
    import torch

    def fed(**change: Any) -> Callable[[Path], Any]:
        return lambda d: _small_run(d, federation=_federation(**change))

    def frozen(d: Path) -> Any:
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8, 3))
        model[1].weight.requires_grad_(False)
        return _small_run(d, model=model, federation=_federation())

    calls: dict[str, Callable[[Path], Any]] = {
        "config is a number": lambda d: _small_run(d, config=42),
        "config is a missing file": lambda d: _small_run(d, config=d / "nope.yaml"),
        "model is a number": lambda d: _small_run(d, model=7, federation=_federation()),
        "model is an unknown name": lambda d: _small_run(
            d, model="resnet-9000", federation=_federation()
        ),
        "federation is a list": lambda d: _small_run(d, federation=[1, 2, 3]),
        "algorithm is a number": lambda d: _small_run(d, federation=_federation(), algorithms=[3]),
        "algorithm name unknown": lambda d: _small_run(
            d, federation=_federation(), algorithms=["fedmagic"]
        ),
        "rounds negative": lambda d: _small_run(d, federation=_federation(), rounds=-3),
        "seeds not integers": lambda d: _small_run(d, federation=_federation(), seeds=["a"]),
        "labels out of range": fed(labels=lambda y: y + 5),
        "negative labels": fed(labels=lambda y: y - 1),
        "float labels": fed(labels=lambda y: y.float() + 0.5),
        "empty test splits": fed(empty_test=True),
        "no classes": fed(n_classes=0),
        "ten million classes": fed(n_classes=10**7),
        "frozen layers": frozen,
        "jobs zero": lambda d: _small_run(d, federation=_federation(), jobs=0),
    }
    return [Case(f"api: {name}", "python api", _api(call)) for name, call in calls.items()]


def resource_cases() -> list[Case]:
    """Configs whose computation cannot fit: refused before anything is allocated."""
    settings = {
        "train.steps at its maximum": "train={steps: 10000000, lr: 0.1, batch_size: 8}",
        "train.epochs at its maximum": "train={epochs: 10000000, lr: 0.1, batch_size: 8}",
        "ten million clients": "data.partition={name: iid, n_clients: 10000000}",
        "a huge synthetic dataset": (
            "data={dataset: synthetic, options: {n_clients: 1000000, n_features: 1000000}, "
            "partition: {name: natural}}"
        ),
        "IFCA with a million clusters": "algorithms=[{name: ifca, params: {n_clusters: 1000000}}]",
        "a billion rounds of checkpoints": "rounds=1000000000",
        "a huge hidden layer": "model.options.hidden=[100000000]",
    }
    cases = [
        Case(f"resources: {k}", "resources", run_args("--set", v)) for k, v in settings.items()
    ]
    deep = "a." * 60_000 + "b=1"
    cases.append(Case("resources: a 60,000-level --set key", "resources", run_args("--set", deep)))
    lrs = ",".join(f"{0.001 * (i + 1):.3f}" for i in range(1000))
    sizes = ",".join(str(i + 1) for i in range(1000))
    cases.append(
        Case(
            "resources: a sweep of a million combinations",
            "resources",
            run_args("--sweep", f"train.lr={lrs}", "--sweep", f"train.batch_size={sizes}"),
        )
    )
    return cases


def _signal_after(seconds: float, signum: int, argv: list[str]) -> Callable[[Path], int]:
    """Run ``argv`` and deliver ``signum`` to this process after ``seconds``."""

    def go(d: Path) -> int:
        # a benchmark started in the background inherits SIGINT ignored (POSIX shells do
        # that to `&` jobs); a user's terminal delivers it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(seconds, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        try:
            return cli_main(argv)
        finally:
            timer.cancel()  # a run that ended first is not signalled afterwards

    return go


SIGNAL_ROUNDS = 400
"""Rounds of the interrupted run: a few seconds of the tiny federation, so that a
signal after one second arrives mid-run."""


def _resumes_to_a_full_run(d: Path) -> bool:
    """After an interrupt: ``resume`` completes the run (or, when the interrupt came
    before the first checkpoint, a fresh run into the same ``--out`` does)."""
    stderr = (d / "stderr").read_text().strip().splitlines()
    if not stderr or not stderr[-1].startswith("fedcluster: interrupted"):
        return False
    run = d / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if (run / "config.yaml").is_file():
            code = cli_main(["resume", str(run), "--quiet", "--no-report"])
        else:
            code = cli_main(["run", *TINY, *_long_run(), "--out", str(run)])
    if code != 0 or not (run / "summary.json").is_file():
        return False
    return len((run / "metrics.csv").read_text().splitlines()) == SIGNAL_ROUNDS + 1


def _long_run() -> list[str]:
    return ["--set", f"rounds={SIGNAL_ROUNDS}", "--set", "checkpoint_every=1"]


def signal_cases() -> list[Case]:
    """Ctrl-C and SIGTERM at start-up and mid-run: one line, a resumable directory."""
    cases = []
    for name, signum in (("Ctrl-C", signal.SIGINT), ("SIGTERM", signal.SIGTERM)):
        for when, seconds in (("at start-up", 0.05), ("mid-run", 1.0)):
            argv = ["run", *TINY, *_long_run(), "--out", "run"]
            cases.append(
                Case(
                    f"signals: {name} {when}",
                    "signals",
                    _signal_after(seconds, signum, argv),
                    expect="interrupted",
                    check=_resumes_to_a_full_run,
                )
            )
    return cases


def _refused_report(content: Callable[[], Any]) -> Callable[[Path], int]:
    """The server's check of a forged ``query.setup`` reply: refused in one line."""

    def go(d: Path) -> int:
        from fedcluster.flower.verify import setup_report

        try:
            setup_report(content())
        except FedclusterError as exc:
            print(f"fedcluster: error: node 7 refused: {exc}", file=sys.stderr)
            return 2
        return 0

    return go


def _setup_reply(**change: Any) -> Callable[[], Any]:
    def build() -> Any:
        from flwr.app import ArrayRecord, ConfigRecord, RecordDict

        from fedcluster.flower import messages

        info: dict[str, Any] = {
            messages.CLIENTS: [0, 1],
            "n_clients": 4,
            "n_classes": 10,
            "input_shape": [64],
        }
        for j in range(2):
            info[messages.prefix(j) + "train_size"] = 20
            info[messages.prefix(j) + "test_size"] = 5
        info.update(change)
        for key in [k for k, v in info.items() if v is None]:
            del info[key]
        content = RecordDict()
        content["arrays"] = ArrayRecord()
        content["config"] = ConfigRecord(info)
        return content

    return build


def node_report_cases() -> list[Case]:
    """Forged setup replies of a Flower node (the server builds its federation from
    them): each is refused with one line, never used."""
    from fedcluster.flower import messages

    forged = {
        "no client list": {messages.CLIENTS: None},
        "client ids repeat": {messages.CLIENTS: [0, 0]},
        "a negative client id": {messages.CLIENTS: [-1, 1]},
        "a client id of 10^15": {messages.CLIENTS: [10**15, 1]},
        "a negative sample count": {messages.prefix(0) + "train_size": -400},
        "a sample count of 10^12": {messages.prefix(0) + "train_size": 10**12},
        "10^8 classes": {"n_classes": 10**8},
        "zero classes": {"n_classes": 0},
        "an input of 10^10 values": {"input_shape": [100000, 100000]},
        "an input shape that is text": {"input_shape": "64"},
        "a missing test size": {messages.prefix(1) + "test_size": None},
        "float client ids": {messages.CLIENTS: [0.5, 1.5]},
    }
    return [
        Case(f"node report: {name}", "node reports", _refused_report(_setup_reply(**change)))
        for name, change in forged.items()
    ]


HF_SOURCES: dict[str, tuple[str, bytes | None]] = {
    # name: (data.dataset, the file's bytes written first; None: no file)
    "Parquet file that is not Parquet": ("bad.parquet", b"garbage"),
    "Parquet file missing": ("missing.parquet", None),
    "CSV of text features": ("text.csv", b"a,b,label\nx,1,0\ny,2,1\n"),
    "CSV with float labels": ("float.csv", b"a,label\n1,0.5\n2,1.5\n"),
    "CSV with negative labels": ("negative.csv", b"a,label\n1,0\n2,-1\n"),
    "CSV without a label column": ("nolabel.csv", b"a,b\n1,2\n3,4\n"),
    "hub dataset not in the cache": ("hf:nobody/no-such-dataset", None),
}


def hf_cases() -> list[Case]:
    """Data from the Hugging Face ecosystem that cannot be a federation."""
    cases = []
    for name, (source, content) in HF_SOURCES.items():

        def go(d: Path, source: str = source, content: bytes | None = content) -> int:
            if content is not None:
                (d / source).write_bytes(content)
            target = source if source.startswith("hf:") else str(d / source)
            partition = "{name: iid, n_clients: 2, test_fraction: 0.5}"
            data = f"data={{dataset: {target}, partition: {partition}}}"
            return cli_main(["run", *TINY, "--set", data, "--out", str(d / "run")])

        cases.append(Case(f"hf data: {name}", "user code", go))
    return cases


def new_family_cases() -> list[Case]:
    """Every case of this module."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        nodes: list[Case] = []
    else:
        nodes = node_report_cases()
    listing = Case("user code: list algorithms", "user code", cli("list", "algorithms"), "ok")
    try:
        import datasets  # noqa: F401
    except ImportError:
        hf: list[Case] = []
    else:
        hf = hf_cases()
    return [
        *user_code_cases(),
        *hf,
        listing,
        *api_cases(),
        *resource_cases(),
        *signal_cases(),
        *nodes,
    ]
