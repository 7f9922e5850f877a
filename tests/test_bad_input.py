"""Bad input that once ended in tracebacks or silent nonsense.

Each case goes through the CLI: exit code 2, one ``fedcluster: error:`` line
naming the file or key, no traceback, and no run directory left behind.
"""

from __future__ import annotations

import warnings

import pytest

from fedcluster.cli import main
from fedcluster.config.schema import MAX_ROUNDS, resolve_config
from fedcluster.experiment.runner import select_clients
from tests.helpers import TINY_RUN_SETS

TINY = ["--quiet", "--rounds", "1", *TINY_RUN_SETS]


def _directory(tmp_path):
    (tmp_path / "cfg").mkdir()
    return [str(tmp_path / "cfg")], "is a directory"


def _empty(tmp_path):
    (tmp_path / "empty.yaml").write_text("\n# nothing here\n")
    return [str(tmp_path / "empty.yaml")], "is empty"


def _out_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("a file")
    return ["--out", str(tmp_path / "taken")], "is an existing file"


def _huge_model(tmp_path):
    return ["--set", "model.options.hidden=[1000000, 1000000]"], "parameters"


def _infinite_epsilon(tmp_path):
    return ["--set", "privacy={mode: client, epsilon: .inf}"], "privacy.epsilon"


def _absurd_rounds(tmp_path):
    return ["--rounds", "1000000000000"], "rounds"


def _nan_lr(tmp_path):
    return ["--set", "train.lr=.nan"], "train.lr"


def _anchor_bomb(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    (tmp_path / "bomb.yaml").write_text("\n".join(levels) + "\nname: *a8\n")
    return [str(tmp_path / "bomb.yaml")], "aliases are expanded"


def _nested(tmp_path):
    return ["--set", "x=" + "[" * 50_000 + "]" * 50_000], "nested deeper than"


HOSTILE_FILES = {  # one-line errors of hostile files and paths (no traceback, hang or nonsense)
    "anchor-bomb": _anchor_bomb,
    "nested-50000": _nested,
    "config-dev-zero": lambda tmp_path: (["/dev/zero"], "not a regular file"),
    "count-true": lambda tmp_path: (  # `rounds: true` ran 1 round (--rounds 1 wins here)
        ["--set", "eval_every=true"],
        "field 'eval_every': expected a number",
    ),
    "label-as-text": lambda tmp_path: (
        ["--set", "scenario.drift=[{kind: swap_labels, rounds: [1], labels: ['7', 1]}]"],
        "labels.0': expected a number",
    ),
    "lr-1e300": lambda tmp_path: (["--set", "train.lr=1e300"], "train.lr"),
    "hidden-zero": lambda tmp_path: (["--set", "model.options.hidden=[0]"], "hidden"),
    "client-dp-tiny-epsilon": lambda tmp_path: (
        ["--set", "privacy={mode: client, epsilon: 1.0e-12}"],
        "no noise level",
    ),
    "name-escapes": lambda tmp_path: (["--set", "name=../../x"], "name '../../x'"),
    "drift-after-the-last-round": lambda tmp_path: (
        ["--set", "scenario.drift=[{kind: rotate, rounds: [999]}]"],
        "would never happen",
    ),
    "out-in-proc": lambda tmp_path: (["--out", "/proc/version/run"], "/proc/version/run"),
}

CASES = {
    **HOSTILE_FILES,
    "config-is-a-directory": _directory,
    "empty-config": _empty,
    "out-is-a-file": _out_is_a_file,
    "model-too-large": _huge_model,
    "epsilon-inf": _infinite_epsilon,
    "absurd-rounds": _absurd_rounds,
    "nan-learning-rate": _nan_lr,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    extra, named = CASES[case](tmp_path)
    out = ["--out", str(tmp_path / "run")] if "--out" not in extra else []
    assert main(["run", *TINY, *out, *extra]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("fedcluster: error:")]
    assert len(errors) == 1, err
    assert named in errors[0] and err.rstrip().endswith(errors[0])  # nothing after the line
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # a run that never started leaves nothing


def test_round_bound_is_explicit():
    assert resolve_config(None, None, [], {"rounds": MAX_ROUNDS}).rounds == MAX_ROUNDS


def test_participation_count_above_the_clients_warns_with_both_numbers():
    cfg = resolve_config(None, None, ["participation.count=30"], {})
    with pytest.warns(UserWarning, match=r"participation.count 30 .* clients 24"):
        chosen = select_clients(24, cfg, seed=0, rnd=1)
    assert chosen.tolist() == list(range(24))
    cfg = resolve_config(None, None, ["participation.count=5"], {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when the count fits
        assert len(select_clients(24, cfg, seed=0, rnd=1)) == 5


def test_compare_with_no_algorithm_is_an_error(tmp_path, capsys):
    assert main(["compare", *TINY, "--out", str(tmp_path / "r"), "--algorithms", " , "]) == 2
    assert "--algorithms ' , ': give at least one" in capsys.readouterr().err


# ------------------------------------------------------------------ resources bounded up front


def test_batch_plan_estimate_counts_the_steps_batch_plan_draws():
    """The estimate's step count per client is the number of batches ``batch_plan`` draws
    (epochs × ⌈n/B⌉, or ``steps``), each charged its index tensor and indices."""
    import numpy as np

    from fedcluster.experiment.capacity import INDEX_BYTES, PLAN_STEP_BYTES, batch_plan_bytes
    from fedcluster.protocol.batches import LocalTraining, batch_plan

    sizes = np.array([0, 5, 37, 64])
    for epochs, steps in ((3, None), (1, 11)):
        cfg = LocalTraining(lr=0.1, batch_size=16, epochs=epochs, steps=steps)
        drawn = [batch_plan(int(n), cfg, 0, "train", 1, c) for c, n in enumerate(sizes)]
        want = sum(
            len(plan) * (PLAN_STEP_BYTES + INDEX_BYTES * min(16, int(n)))
            for plan, n in zip(drawn, sizes, strict=True)
        )
        assert batch_plan_bytes(sizes, 16, epochs, steps) == want


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (["train.steps=10000000"], "train.steps 10,000,000: the 4 clients' mini-batch plans"),
        (["train.epochs=10000000"], "train.epochs 10,000,000: the 4 clients' mini-batch plans"),
        (
            ["algorithms=[{name: ifca, params: {n_clusters: 1000000}}]"],
            "algorithms.0.params.n_clusters: 1,000,000 for 4 clients",
        ),
    ],
)
def test_resources_beyond_the_machine_are_refused_up_front(
    tmp_path, capsys, monkeypatch, sets, named
):
    """At their documented maxima, local steps and epochs are refused with the estimate
    (memory allowed fixed at 8 GiB here, so the outcome does not depend on the machine);
    a million clusters for 4 clients is refused before any model is built."""
    monkeypatch.setattr("fedcluster.experiment.capacity.allowed_bytes", lambda: 8 * 2**30)
    extra = [a for s in sets for a in ("--set", s)]
    assert main(["run", *TINY, "--out", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("fedcluster: error:")]
    assert len(errors) == 1 and named in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            ["--set", "data.partition={name: iid, n_clients: 10000000, test_fraction: 0.2}"],
            "data.partition.n_clients: 10,000,000 clients for",
        ),
        (
            ["--set", "data={dataset: synthetic, options: {n_clients: 10000000}}"],
            "synthetic: 10,000,000 clients of 60 features need about",
        ),
        (
            ["--set", "data={dataset: synthetic, options: {n_features: 100000000}}"],
            "synthetic: n_features must be an integer in 1..16777216",
        ),
        (
            ["--set", "data={dataset: synthetic, options: {alpha: 1e300}}"],
            "synthetic: alpha must be a number in 0..1000",
        ),
        (
            ["--set", "algorithms=[{name: ifca}]"]
            + ["--sweep", "algorithms.ifca.lr_scale=" + ",".join(str(i) for i in range(1000))]
            + ["--sweep", "algorithms.ifca.n_clusters=" + ",".join(str(i) for i in range(1000))],
            "--sweep: 1,000,000 algorithm entries",
        ),
    ],
    ids=["partition-clients", "synthetic-clients", "synthetic-features", "alpha", "sweep"],
)
def test_sizes_beyond_the_data_or_machine_are_refused_before_allocation(
    tmp_path, capsys, monkeypatch, extra, named
):
    """Memory allowed fixed at 8 GiB, so the outcome does not depend on the machine."""
    monkeypatch.setattr("fedcluster.data.synthetic.allowed_bytes", lambda: 8 * 2**30)
    assert main(["run", *TINY, "--out", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("fedcluster: error:")]
    assert len(errors) == 1 and named in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_the_synthetic_memory_estimate_follows_the_client_sizes_drawn():
    """The estimate's mean client size is the drawn sizes' mean (lognormal(4, 2) + 50) to
    within their sampling error, and its bytes per sample are float32 inputs + a label."""
    import numpy as np

    from fedcluster.data.synthetic import MEAN_CLIENT_SIZE, synthetic_bytes, synthetic_federation

    clients = synthetic_federation(400, 0.5, 0.5, seed=0, n_features=4, n_classes=3)
    sizes = np.array([len(y) for _, y in clients])
    # lognormal(4, 2)'s standard deviation is ~2,900: the mean of 400 is within 3 σ/√400
    assert abs(sizes.mean() - MEAN_CLIENT_SIZE) < 3 * 2_990 / np.sqrt(400)
    assert all(x.dtype == np.float32 and x.shape[1] == 4 for x, _ in clients)
    assert synthetic_bytes(1, 4, 3) == MEAN_CLIENT_SIZE * (4 * 4 + 8) + 8 * 5 * 4


def test_a_60000_level_set_key_is_one_line(tmp_path, capsys):
    key = ".".join(["a"] * 60_000)
    assert main(["run", *TINY, "--out", str(tmp_path / "run"), "--set", f"{key}=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nested 60000 levels, at most 64" in err, err[:300]
