"""The worked examples of docs/architecture.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from fedcluster.algorithms import ALGORITHMS
from fedcluster.config.schema import validate_config
from fedcluster.experiment.callbacks import Callback
from fedcluster.experiment.runner import Experiment
from fedcluster.protocol.computation import COMPUTATIONS
from tests.helpers import digits_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_algorithm_example_runs(tmp_path):
    block = next(b for b in _blocks() if "class MomentumAvg" in b)
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    try:
        # With β = 0 server momentum is plain FedAvg: the same numbers, round by round.
        algorithms = [{"name": "fedavgm", "params": {"beta": 0.0}}, {"name": "fedavg"}]
        config = validate_config(digits_config("docs-example", 3, algorithms))
        momentum, plain = Experiment(config).run(tmp_path, progress=False)
        for a, b in zip(momentum.rows, plain.rows, strict=True):
            assert a["accuracy"] == b["accuracy"] and a["bytes_up"] == b["bytes_up"]
            assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"])
    finally:
        ALGORITHMS.pop("fedavgm", None)


def test_the_computation_example_registers_and_answers(tmp_path):
    block = next(b for b in _blocks() if "LABEL_MEAN = register_computation" in b)
    declaration = block.split("# in an algorithm's run_round:")[0]
    namespace: dict = {}
    exec(compile(declaration, str(DOC), "exec"), namespace)
    try:
        computation = COMPUTATIONS["label-mean"]
        assert computation.bytes_up(namespace["Request"]()) == 4
    finally:
        COMPUTATIONS.pop("label-mean", None)


def test_the_batched_computation_example_equals_its_one_client_form():
    """The ClientBatch form of the example replies, client by client, what its
    ClientContext form computes."""
    import torch

    from fedcluster.algorithms.base import init_row
    from fedcluster.engine.simulator import Simulator
    from fedcluster.models import build_model
    from fedcluster.protocol.client_side import ClientContext
    from fedcluster.protocol.computation import Request
    from tests.helpers import rotated_digits

    block = next(b for b in _blocks() if "MODEL_LOSS = register_computation" in b)
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    try:
        computation = COMPUTATIONS["model-loss"]
        fed = rotated_digits(n_groups=2, clients_per_group=2, per_client=40)
        model = build_model("mlp", fed.input_shape, fed.n_classes, hidden=[8])
        sim = Simulator(model, fed, seed=0)
        ask = Request(shared={"model": init_row(model, 0, "init")})
        clients = np.array([3, 0, 2])
        batched = computation.run(sim, clients, ask)["loss"]
        assert batched.shape == (3,) and batched.dtype == torch.float32
        for j, c in enumerate(clients):
            one = namespace["model_loss"](ClientContext(sim, int(c)), ask.client(j))["loss"]
            # the two evaluation routes sum the same float32 losses in other orders and
            # blockings: a few float32 roundings apart (2^-23 each) relative to the mean
            torch.testing.assert_close(batched[j], one, rtol=1e-5, atol=0.0)
    finally:
        COMPUTATIONS.pop("model-loss", None)


def test_the_callback_example_stops_a_job(tmp_path, capsys):
    block = next(b for b in _blocks() if "class StopAtAccuracy" in b)
    definition = block.split("config = resolve_config")[0]
    namespace: dict = {}
    exec(compile(definition, str(DOC), "exec"), namespace)
    stop = namespace["StopAtAccuracy"](0.0)  # any accuracy stops after round 1
    assert isinstance(stop, Callback)
    config = validate_config(digits_config("docs-callback", 4, [{"name": "fedavg"}]))
    (result,) = Experiment(config, callbacks=[stop]).run(tmp_path, progress=False)
    assert len(result.rows) == 1
    assert "fedavg seed 0 round 1" in capsys.readouterr().out
    assert np.isfinite(result.rows[0]["accuracy"])


TUTORIAL = DOC.parent / "tutorial.md"


def test_the_tutorial_runs_as_written(tmp_path, monkeypatch):
    """docs/tutorial.md's code blocks, in order, as one program (2 rounds instead of 20)."""
    blocks = re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), flags=re.S)
    program = "".join(blocks)
    lines = [line for line in program.splitlines() if line.strip()]
    assert len(lines) <= 80  # the whole study in 80 lines (blank lines aside)
    assert program.count("rounds=20") == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "tutorial"}
    try:
        exec(compile(program.replace("rounds=20", "rounds=2"), str(TUTORIAL), "exec"), namespace)
    finally:
        ALGORITHMS.pop("kmeans-once", None)
    result = namespace["result"]
    accuracy = result.final_accuracy()
    assert sorted(accuracy) == ["fedavg", "fedgroup", "ifca", "kmeans-once"]
    assert all(0.0 <= a <= 1.0 for a in accuracy.values())
    assert (tmp_path / "runs/tutorial/report.html").is_file()
    # the method's clusters after round 1 are k-means' labels of the updates: 3 clusters
    kmeans = [r for r in result.metrics if r["algorithm"] == "kmeans-once"]
    assert [r["n_clusters"] for r in kmeans] == [3, 3]
