"""The bad-input family's newer classes, a sample of each run in process through the
family's own classifier (benchmarks/robustness/bad_inputs.py): user code that breaks
its contract, Python API misuse, configs beyond the machine, signals, forged node
reports. Every case must end clean: one named error (or, for a NaN model, a run
whose every upload is rejected by name), never a traceback or a silent result."""

from __future__ import annotations

import sys

import pytest

from benchmarks.robustness.bad_inputs import classify
from benchmarks.robustness.user_code_family import (
    USER_MODULE,
    api_cases,
    node_report_cases,
    resource_cases,
    signal_cases,
    user_code_cases,
)

SAMPLE = {
    "user code": (
        user_code_cases,
        [
            "model returns NaN",
            "loss returns NaN",
            "model returns the wrong width",
            "model with no parameters",
            "loss raises",
            "partition plugin returns None",
            "partition plugin returns foreign indices",
        ],
    ),
    "python api": (api_cases, ["float labels", "empty test splits", "frozen layers"]),
    "resources": (
        resource_cases,
        ["a sweep of a million combinations", "train.steps at its maximum"],
    ),
    "signals": (signal_cases, ["SIGTERM at start-up", "Ctrl-C mid-run"]),
    "node reports": (node_report_cases, ["10^8 classes", "float client ids"]),
}
PARAMS = [
    pytest.param(family, name, id=f"{family}: {name}")
    for family, (_, names) in SAMPLE.items()
    for name in names
]


@pytest.mark.parametrize(("family", "name"), PARAMS)
def test_each_class_of_bad_input_ends_clean(family, name, tmp_path, capsys, monkeypatch):
    if family == "node reports":
        pytest.importorskip("flwr")
    make, _ = SAMPLE[family]
    (case,) = [c for c in make() if c.name.endswith(f": {name}")]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # user-code cases put tmp_path first
    monkeypatch.delitem(sys.modules, USER_MODULE, raising=False)
    try:
        code = case.run(tmp_path)
    finally:
        sys.modules.pop(USER_MODULE, None)
    err = capsys.readouterr().err
    (tmp_path / "stderr").write_text(err)
    outcome = classify(case, code, err, tmp_path)
    assert outcome == case.expect.replace("interrupted", "error"), err[-2000:]
