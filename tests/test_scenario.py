"""Dynamic federations: joins, drift, availability, failures, faulty clients, resume."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import fedcluster.experiment.runner as runner_module
from fedcluster.algorithms import ALGORITHMS, algorithm_params
from fedcluster.config.schema import ExperimentConfig, resolve_config, validate_config
from fedcluster.data.drift import DriftEvent, DriftReplay, apply_drift
from fedcluster.engine.simulator import Simulator
from fedcluster.errors import ConfigError
from fedcluster.experiment.metrics import TIMING_COLUMNS
from fedcluster.experiment.rundir import load_checkpoint
from fedcluster.experiment.runner import Experiment, resume
from fedcluster.experiment.scenario import FaultyUploads, Scenario
from fedcluster.protocol.channel import UpdateBound
from tests.helpers import FLOAT_BYTES, INT_BYTES, make_context, rotated_digits

MLP = {"name": "mlp", "options": {"hidden": [32]}}
TRAIN = {"lr": 0.1, "batch_size": 16}
# Parameters under which each clustering algorithm finds 4 clear groups within a few rounds.
CLUSTERED = {
    "dcfl": {},
    "fedgroup": {"n_groups": 4, "pretrain_scale": 4},
    "fedgrouprox": {"n_groups": 4, "pretrain_scale": 4},
    "ifca": {"n_clusters": 4},
    "jgl": {"n_clusters": 4},
    "cfl": {"eps1": 1e9, "eps2": 0.0, "warmup_rounds": 1, "min_cluster_size": 4},
    "flhc": {"pretrain_rounds": 2, "n_clusters": 4},
    "fesem": {"n_clusters": 4},
    "pacfl": {"n_clusters": 4},
    "wecfl": {"n_clusters": 4},
    "flux": {"pretrain_rounds": 2},
}


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR, logger="fedcluster")  # rejections are expected here


@pytest.fixture(scope="module")
def rotated():
    """20 clients of mnist5k in 4 rotation groups (client c in group c mod 4)."""
    return rotated_digits(n_groups=4, clients_per_group=5, per_client=80, dataset="mnist5k")


def config(algorithms: list[dict], rounds: int, scenario: dict, **more) -> ExperimentConfig:
    raw = {
        "rounds": rounds,
        "model": MLP,
        "train": TRAIN,
        "eval_every": 100,
        "checkpoint_every": 100,
        "scenario": scenario,
        "algorithms": algorithms,
    }
    return validate_config({**raw, **more})


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def clusters_at(out: Path, algorithm: str, rnd: int) -> np.ndarray:
    got = [r for r in rows(out / "clusters.csv") if r["algorithm"] == algorithm]
    return np.array([int(r["cluster"]) for r in got if int(r["round"]) == rnd])


def majority(labels: np.ndarray) -> int:
    return int(np.bincount(labels[labels >= 0]).argmax())


# ---------------------------------------------------------------- the schedule


def test_join_schedule_presence_and_availability():
    raw = {"joins": {"every": 10, "count": 3, "first": 5, "at": {0: 2}}, "leaves": {1: 7}}
    cfg = validate_config({"scenario": {**raw, "availability": 0.5}}).scenario
    sc = Scenario(cfg, n_clients=10, seed=0, rounds=30)
    assert sc.join_round.tolist() == [2, 1, 1, 1, 1, 1, 1, 5, 15, 25]
    batches = validate_config({"scenario": {"joins": {"every": 2, "count": 5, "size": 2}}})
    assert Scenario(batches.scenario, 6, 0, 9).join_round.tolist() == [1, 2, 2, 4, 4, 6]
    assert sc.joins(5).tolist() == [7] and sc.joins(1).tolist() == []
    assert sc.leaves(7).tolist() == [1]
    assert sc.present(1).tolist() == [False] + [True] * 6 + [False] * 3
    assert not sc.present(7)[1] and sc.present(6)[1]
    available = sc.available(16)
    assert not (available & ~sc.present(16)).any() and 0 < available.sum() < 9
    assert np.array_equal(available, Scenario(cfg, 10, 0, 30).available(16))


def test_invalid_schedules_name_the_field():
    with pytest.raises(ConfigError, match="scenario.joins"):
        validate_config({"scenario": {"joins": {"every": 10}}})
    with pytest.raises(ConfigError, match="scenario.drift"):
        validate_config({"scenario": {"drift": [{"kind": "rotate"}]}})
    with pytest.raises(ConfigError, match="scenario.availability"):
        validate_config({"scenario": {"availability": 0.0}})
    cfg = validate_config({"scenario": {"joins": {"at": {12: 3}}}}).scenario
    with pytest.raises(ConfigError, match=r"scenario\.joins\.at: client 12 does not exist"):
        Scenario(cfg, n_clients=10, seed=0, rounds=5)


def test_random_drift_hits_a_present_client_reproducibly():
    raw = {"joins": {"rounds": [20] * 5}, "drift": [{"kind": "rotate", "every": 10, "first": 5}]}
    cfg = validate_config({"scenario": raw}).scenario
    sc = Scenario(cfg, n_clients=10, seed=3, rounds=30)
    events = sc.drifts_through(30)
    assert [e.round for e in events] == [5, 15, 25]
    assert all(sc.present(e.round)[e.client] for e in events)
    assert events == Scenario(cfg, n_clients=10, seed=3, rounds=30).drifts_through(30)


def test_drift_kinds_change_one_clients_data_in_place(rotated):
    fed = rotated.clone()
    rows0 = fed.client_slice(0)
    before = fed.x_train[rows0].clone()
    other = fed.x_train[fed.client_slice(1)].clone()
    for _ in range(2):
        apply_drift(fed, DriftEvent(round=1, client=0, kind="rotate", seed=0, angle=90.0))
    assert torch.equal(fed.x_train[rows0], torch.rot90(before, 2, dims=(-2, -1)))
    assert torch.equal(fed.x_train[fed.client_slice(1)], other)
    assert torch.equal(rotated.x_train[rows0], before)  # the clone is independent
    assert fed.revisions.tolist()[:2] == [2, 0]  # the simulator's caches follow revisions

    y = fed.y_train[rows0].clone()
    detail = apply_drift(fed, DriftEvent(round=1, client=0, kind="swap_labels", seed=0))
    a, b = (int(s) for s in detail.split()[2::2])
    assert detail.startswith("swapped") and torch.equal(
        fed.y_train[rows0], torch.where(y == a, b, torch.where(y == b, a, y))
    )
    with pytest.raises(ConfigError, match="redistribute"):
        apply_drift(fed, DriftEvent(round=1, client=0, kind="redistribute", seed=0))


def test_a_replay_follows_the_events_it_is_told_and_restores_for_a_new_list(rotated):
    """What a Flower node does with its client's events: apply the new ones, or
    restore the data as exported and apply a list that does not continue the last."""
    one = rotated.subset([0])
    exported = one.clone()
    first = DriftEvent(round=1, client=0, kind="rotate", seed=1, angle=90.0)
    second = DriftEvent(round=2, client=0, kind="swap_labels", seed=2, labels=(1, 2))
    replay = DriftReplay(one)
    replay.follow([first])
    want = exported.clone()
    apply_drift(want, first)
    assert torch.equal(one.x_train, want.x_train)
    replay.follow([first, second])  # only the new event
    apply_drift(want, second)
    assert torch.equal(one.x_train, want.x_train) and torch.equal(one.y_train, want.y_train)
    replay.follow([second])  # another job: from the exported data
    want = exported.clone()
    apply_drift(want, second)
    assert torch.equal(one.x_train, want.x_train) and torch.equal(one.y_test, want.y_test)
    replay.follow([])
    assert torch.equal(one.x_train, exported.x_train) and torch.equal(one.y_train, exported.y_train)


def test_redistribute_redraws_with_the_same_counts(tmp_path):
    drift = {"kind": "redistribute", "rounds": [2], "clients": [1], "alpha": 0.1}
    cfg = resolve_config(
        None,
        "quickstart",
        [
            "data.partition={name: iid, n_clients: 6, test_fraction: 0.2}",
            "rounds=2",
            f"scenario.drift=[{drift}]",
        ],
    )
    exp = Experiment(cfg)
    fed, pool = exp.data(0)
    copy = fed.clone()
    detail = apply_drift(copy, Scenario(cfg.scenario, 6, 0, 2).drifts(2)[0], pool)
    assert detail.startswith("new label counts")
    assert np.array_equal(copy.train_offsets, fed.train_offsets)
    old, new = (
        np.bincount(f.y_train[f.client_slice(1)].numpy(), minlength=10) for f in (fed, copy)
    )
    assert old.sum() == new.sum() and (new > 0).sum() < (old > 0).sum()  # alpha 0.1: few labels
    assert torch.equal(copy.x_train[copy.client_slice(0)], fed.x_train[fed.client_slice(0)])


# ---------------------------------------------------------------- newcomers


@pytest.mark.parametrize("name", sorted(CLUSTERED))
def test_newcomers_land_in_their_groups_cluster(rotated, tmp_path, name):
    """Clients 16-19 (groups 0-3) join after the clustering; each joins its group's cluster."""
    spec = {"name": name, "params": CLUSTERED[name]}
    Experiment(config([spec], 8, {"joins": {"rounds": [5, 5, 6, 6]}}), federation=rotated).run(
        tmp_path, progress=False
    )
    labels, groups = clusters_at(tmp_path, name, 8), rotated.groups
    for c in range(16, 20):
        mates = labels[:16][groups[:16] == groups[c]]
        assert labels[c] == majority(mates), (c, labels.tolist())
    assert (clusters_at(tmp_path, name, 4)[16:] == -1).all()  # not present yet


def test_cflgt_newcomers_land_in_their_label_groups_cluster(tmp_path):
    """CFLGT clusters by labels: 4 label groups of 5 clients, one late client per group."""
    partition = {
        "name": "label_combinations",
        "n_combinations": 4,
        "labels_per_combination": 2,
        "samples_per_label": 40,
        "n_clients": 20,
        "test_fraction": 0.25,
    }
    late = {4: 5, 9: 5, 14: 6, 19: 6}
    spec = {"name": "cflgt", "params": {"pretrain_rounds": 2, "cluster_fraction": None}}
    cfg = config(
        [spec], 7, {"joins": {"at": late}}, data={"dataset": "mnist5k", "partition": partition}
    )
    Experiment(cfg).run(tmp_path, progress=False)
    labels = clusters_at(tmp_path, "cflgt", 7)
    groups = np.arange(20) // 5
    assert len(np.unique(labels)) == 4
    for c in late:
        mates = np.setdiff1d(np.flatnonzero(groups == groups[c]), list(late))
        assert labels[c] == majority(labels[mates])


def test_a_client_never_trains_before_it_joins(rotated, tmp_path, monkeypatch):
    """Every client computation of client 3 (joining at round 3) happens from round 3 on."""
    now = {"round": 0}
    seen: list[tuple[int, int]] = []

    run_computation = Simulator.run

    def spy(sim, computation, clients, request):  # every client computation passes here
        if computation.name != "evaluate":  # evaluation is the experimenter's measurement
            seen.extend((now["round"], int(c)) for c in np.asarray(clients))
        return run_computation(sim, computation, clients, request)

    start_round = runner_module.Job._start_round

    def start_round_spy(job, rnd):
        now["round"] = rnd
        return start_round(job, rnd)

    monkeypatch.setattr(runner_module.Job, "_start_round", start_round_spy)
    monkeypatch.setattr(Simulator, "run", spy)
    small = {**CLUSTERED, "flhc": {"pretrain_rounds": 1}, "cfl": {"warmup_rounds": 1}}
    specs = [{"name": n, "params": small.get(n, {})} for n in sorted(ALGORITHMS)]
    specs[[s["name"] for s in specs].index("cflgt")]["params"] = {
        "pretrain_rounds": 1,
        "cluster_fraction": None,
    }
    cfg = config(specs, 4, {"joins": {"at": {3: 3}}}, eval_every=1)
    Experiment(cfg, federation=rotated).run(tmp_path, progress=False)
    rounds_of_3 = {r for r, c in seen if c == 3}
    assert min(rounds_of_3) == 3 and len(seen) > 0
    joins = [r for r in rows(tmp_path / "events.csv") if r["kind"] == "join"]
    assert {(r["algorithm"], r["round"], r["client"]) for r in joins} == {
        (s["name"], "3", "3") for s in specs
    }


# ---------------------------------------------------------------- drift


def test_dcfl_moves_a_drifting_client_to_its_new_group(tmp_path):
    """Client 0 (group 0, upright) is turned by 180 degrees at round 4: it joins group 2."""
    fed = rotated_digits(n_groups=4, clients_per_group=4, per_client=80, dataset="mnist5k")
    pristine = fed.x_train.clone()
    drift = [{"kind": "rotate", "rounds": [4], "clients": [0], "angle": 180}]
    cfg = config([{"name": "dcfl"}], 7, {"drift": drift})
    Experiment(cfg, federation=fed).run(tmp_path, progress=False)
    groups = fed.groups
    before = clusters_at(tmp_path, "dcfl", 3)
    assert before[0] == majority(before[groups == 0])
    after = clusters_at(tmp_path, "dcfl", 7)
    assert after[0] == majority(after[1:][groups[1:] == 2])
    assert after[0] != majority(after[1:][groups[1:] == 0])
    (event,) = [r for r in rows(tmp_path / "events.csv") if r["kind"] == "drift"]
    assert event["round"] == "4" and event["client"] == "0" and "180" in event["detail"]
    assert torch.equal(fed.x_train, pristine)  # each job drifts its own copy


# ---------------------------------------------------------------- failures


def test_failed_clients_are_logged_counted_and_never_block(rotated, tmp_path):
    names = ["fedavg", "dcfl", "cfl", "fedgroup", "jgl", "flhc", "cflgt", "fesem"]
    params = {**CLUSTERED, "cflgt": {"pretrain_rounds": 2, "cluster_fraction": None}}
    specs = [{"name": n, "params": params.get(n, {})} for n in names]
    cfg = config(specs, 6, {"failure_rate": 0.3}, eval_every=1)
    Experiment(cfg, federation=rotated).run(tmp_path, progress=False)
    metrics = rows(tmp_path / "metrics.csv")
    failures = [r for r in rows(tmp_path / "events.csv") if r["kind"] == "failed"]
    assert len(metrics) == 6 * len(names)
    for r in metrics:
        logged = [
            f for f in failures if (f["algorithm"], f["round"]) == (r["algorithm"], r["round"])
        ]
        assert int(r["failed"]) == len(logged) and np.isfinite(float(r["accuracy"]))
    assert sum(int(r["failed"]) for r in metrics) > 0.2 * 20 * len(metrics)
    # FedAvg: every client receives the model; only those that replied upload theirs.
    dim = make_context(rotated, hidden=[32]).dim
    for r in (r for r in metrics if r["algorithm"] == "fedavg"):
        assert int(r["bytes_down"]) == 20 * dim * FLOAT_BYTES
        assert int(r["bytes_up"]) == (20 - int(r["failed"])) * (dim * FLOAT_BYTES + INT_BYTES)


# ---------------------------------------------------------------- faulty clients


def test_server_rejects_absurdly_large_updates(rotated):
    ctx = make_context(rotated, hidden=[16])
    clients = np.arange(6)
    ctx.channel.client_transforms.append(
        FaultyUploads(np.array([-1, 2, -1, -1, -1, -1] + [-1] * 14), 1e4)
    )
    ex = ctx.exchange(clients, ctx.init_row, 1)
    assert ex.clients.tolist() == [0, 2, 3, 4, 5] and ctx.rejected == [1]
    assert "norm" in ctx.channel.events[0][2]
    ctx.channel.start_round()  # two updates are no yardstick; an absolute cap still applies
    assert ctx.exchange(clients[:2], ctx.init_row, 1).clients.tolist() == [0, 1]
    ctx.channel.start_round()
    ctx.channel.bound = UpdateBound(norm_factor=None, max_norm=1e-6)
    assert len(ctx.exchange(clients[:2], ctx.init_row, 1).clients) == 0


def test_faulty_clients_never_poison_a_model(tmp_path):
    """10% of 40 clients send NaN, Inf or huge updates: all rejected, sound clients unaffected."""
    fed = rotated_digits(n_groups=4, clients_per_group=10, per_client=80, dataset="mnist5k")
    specs = [{"name": "fedavg"}, {"name": "dcfl"}]
    seed = 3
    accuracy = {}
    for share in (0.0, 0.1):
        out = tmp_path / str(share)
        cfg = config(specs, 10, {"faulty": {"share": share}}, eval_every=1, seeds=[seed])
        Experiment(cfg, federation=fed).run(out, progress=False)
        metrics = rows(out / "metrics.csv")
        assert all(np.isfinite(float(r["test_loss"])) for r in metrics)
        sc = Scenario(cfg.scenario, fed.n_clients, seed, cfg.rounds)
        faulty = [c for c, _ in sc.faulty()]
        assert all(int(r["rejected"]) == len(faulty) for r in metrics)
        for spec in cfg.algorithms:
            alg = ALGORITHMS[spec.name](
                algorithm_params(spec), make_context(fed, seed=seed, hidden=[32])
            )
            record = load_checkpoint(out / "checkpoints" / f"{spec.name}-seed{seed}.pt").state
            state = alg.StateType.from_record(record)
            models = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
            assert all(torch.isfinite(m).all() for m in models)
            per_client = alg.evaluate(state, cfg.rounds).accuracy
            accuracy[share, spec.name] = np.delete(per_client, faulty).mean()
    assert {fault for _, fault in sc.faulty()} == {"nan", "inf", "huge"}
    for spec in specs:
        assert abs(accuracy[0.1, spec["name"]] - accuracy[0.0, spec["name"]]) < 0.02


# ---------------------------------------------------------------- resume


def test_resume_with_joins_drift_and_failures_equals_uninterrupted_run(tmp_path):
    scenario = {
        "joins": {"every": 3, "count": 2, "first": 3},
        "leaves": {0: 6},
        "availability": 0.9,
        "failure_rate": 0.2,
        "drift": [
            {"kind": "rotate", "every": 3, "first": 2},
            {"kind": "swap_labels", "rounds": [4], "clients": [2]},
            {"kind": "redistribute", "rounds": [5]},
        ],
        "faulty": {"share": 0.1},
    }
    sets = [
        "data.partition={name: rotation, n_groups: 2, base: iid, "
        "base_options: {n_clients: 12, test_fraction: 0.2}}",
        "model.options={hidden: [16]}",
        "rounds=8",
        "checkpoint_every=2",
        "participation.fraction=0.8",
        f"scenario={scenario}",
        "algorithms=[{name: dcfl}, {name: cfl, params: {warmup_rounds: 2, eps1: 1e9, "
        "eps2: 0}}, {name: cflgt, params: {pretrain_rounds: 2, cluster_fraction: 0.5}}]",
    ]
    cfg = resolve_config(None, "quickstart", sets)
    Experiment(cfg).run(tmp_path / "full", progress=False)
    Experiment(cfg).run(tmp_path / "cut", progress=False, stop_after_round=5)
    resume(tmp_path / "cut", progress=False)

    def table(run: str, name: str) -> list[dict[str, str]]:
        got = rows(tmp_path / run / name)
        return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in got]

    for name in ("metrics.csv", "clusters.csv", "events.csv"):
        assert table("cut", name) == table("full", name), name
    kinds = {r["kind"] for r in table("full", "events.csv")}
    assert {"join", "leave", "drift", "failed", "faulty", "rejected"} <= kinds


def test_honest_accuracy_pools_only_the_sound_clients():
    """The diagnostic the reliability table reads: correct / count over the sound clients."""
    from fedcluster.engine.results import EvalResult
    from fedcluster.experiment.metrics import honest_accuracy

    result = EvalResult(
        correct=np.array([8.0, 0.0, 30.0, 1.0]),
        count=np.array([10.0, 10.0, 40.0, 10.0]),
        loss_sum=np.zeros(4),
        clients=np.array([0, 1, 3, 4]),  # client 2's evaluation was rejected
    )
    sound = np.array([True, False, False, True, False])
    assert honest_accuracy(result, sound) == {"honest_accuracy": (8 + 30) / (10 + 40)}
    assert honest_accuracy(result, np.ones(5, dtype=bool)) == {}  # no faulty client: no row


def test_label_flippers_train_on_their_own_flipped_labels(rotated, tmp_path, monkeypatch):
    """``label_flip``: the job's simulator trains the flippers on y → 9 − y, the others on
    their labels; the federation passed in is left as it was (the next job's data)."""
    original = rotated.y_train.clone()
    seen = []
    run_computation = Simulator.run

    def spy(sim, computation, clients, request):
        seen.append(sim.federation.y_train.clone())
        return run_computation(sim, computation, clients, request)

    monkeypatch.setattr(Simulator, "run", spy)
    cfg = config([{"name": "fedavg"}], 1, {"faulty": {"share": 0.25, "kinds": ["label_flip"]}})
    Experiment(cfg, federation=rotated).run(tmp_path, progress=False)
    flippers = Scenario(cfg.scenario, rotated.n_clients, 0, 1).label_flippers()
    assert len(flippers) == 5 and torch.equal(rotated.y_train, original)
    want = original.clone()
    for c in flippers:
        want[rotated.client_slice(int(c))] = 9 - original[rotated.client_slice(int(c))]
    assert seen and all(torch.equal(y, want) for y in seen)
    faulty = {(r["client"], r["detail"]) for r in rows(tmp_path / "events.csv")}
    assert faulty == {(str(c), "label_flip") for c in flippers}
