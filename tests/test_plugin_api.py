"""The plugin API of docs/plugins.md: everything it names is exported from ``fedcluster``,
every public member of the server's Context is documented there and in its docstrings,
every member of Algorithm is in the reference, and the reference's example plugin with
``n_clusters: auto`` runs as written."""

from __future__ import annotations

import csv
import inspect
import re
from pathlib import Path

import numpy as np

import fedcluster
from fedcluster.algorithms.base import ALGORITHMS, Context
from fedcluster.models import build_model
from tests.helpers import digits_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def _example() -> dict:
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    namespace: dict = {"__name__": "plugins_md_example"}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


def test_every_name_the_reference_imports_is_exported():
    blocks = re.findall(r"from fedcluster import \((.*?)\)", DOC.read_text(), flags=re.S)
    names = [n.strip() for b in blocks for n in b.replace("\n", " ").split(",") if n.strip()]
    assert "weighted_loss" in names and "Context" in names
    missing = [n for n in names if not hasattr(fedcluster, n)]
    assert not missing
    assert set(names) <= set(fedcluster.__all__)


def test_every_public_member_of_the_context_is_documented():
    members = [n for n in dir(Context) if not n.startswith("_") and n != "for_backend"]
    fields = set(Context.__dataclass_fields__)
    source = inspect.getsource(Context)
    undocumented = []
    for name in members:
        attr = inspect.getattr_static(Context, name)
        if isinstance(attr, property) or inspect.isfunction(attr):
            doc = (attr.fget if isinstance(attr, property) else attr).__doc__
            if not doc:
                undocumented.append(name)
    for name in fields:  # a field's docstring is the string literal right after it
        if not re.search(rf"\n    {name}: [^\n]+\n    \"\"\"", source):
            undocumented.append(name)
    assert not undocumented
    reference = DOC.read_text()
    assert not [n for n in [*members, *fields] if f"`{n}" not in reference]


def test_every_public_member_of_algorithm_is_in_the_reference():
    members = [n for n in dir(fedcluster.Algorithm) if not n.startswith("_")]
    assert {"cluster_count", "run_round", "eval_rows"} <= set(members)
    reference = DOC.read_text()
    assert not [n for n in members if f"`{n}" not in reference]


def test_the_reference_example_with_n_clusters_auto_runs(tmp_path):
    namespace = _example()
    try:
        seen = {}

        class Probe(namespace["OneShotKMeansAuto"]):  # what the server learns of the model
            name = "kmeans-auto-probe"

            def init_state(self):
                seen.update(
                    n_classes=self.ctx.n_classes, shapes=self.ctx.shapes, k=self.params.n_clusters
                )
                return super().init_state()

        fedcluster.register(Probe)
        config = digits_config("plugin", rounds=2)
        config["data"]["partition"] = {"name": "iid", "n_clients": 6, "test_fraction": 0.2}
        auto = {"n_clusters": "auto", "k_range": [2, 3]}
        result = fedcluster.run(
            config=config,
            algorithms=[
                {"name": "kmeans-auto", "params": auto},
                {"name": "kmeans-auto-probe", "params": auto},
            ],
            rounds=2,
            out=tmp_path / "run",
            report=False,
        )
        jobs = result.summary["jobs"] if isinstance(result.summary, dict) else result.summary
        (job,) = [j for j in jobs if j["algorithm"] == "kmeans-auto"]
        assert job["algorithm"] == "kmeans-auto" and job["rounds"] == 2
        assert 0.0 <= job["final_accuracy"] <= 1.0
        with open(tmp_path / "run" / "select_k.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["algorithm"] == "kmeans-auto-probe"]
        assert {int(r["k"]) for r in rows} == {2, 3}
        (chosen,) = [int(r["k"]) for r in rows if r["chosen"] == "1"]
        assert seen["k"] == chosen  # the algorithm is built with the chosen K
        with open(tmp_path / "run" / "clusters.csv") as f:
            used = {r["cluster"] for r in csv.DictReader(f) if r["algorithm"] == "kmeans-auto"}
        assert 1 <= len(used) <= 3
        model = build_model("mlp", (64,), 10, hidden=[8])
        assert seen["n_classes"] == 10
        assert seen["shapes"] == {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert np.prod(seen["shapes"][next(iter(seen["shapes"]))]) > 0
    finally:  # tests may register their own algorithms, and unregister them
        ALGORITHMS.pop("kmeans-auto", None)
        ALGORITHMS.pop("kmeans-auto-probe", None)
