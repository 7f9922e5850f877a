"""LEAF's JSON format: FEMNIST and Sent140, the writers/users as clients.

LEAF (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings",
github.com/TalwalkarLab/leaf) stores a federated dataset as JSON files::

    {"users": ["f0000_14", ...], "num_samples": [123, ...],
     "user_data": {"f0000_14": {"x": [...], "y": [...]}, ...}}

in a ``train/`` and a ``test/`` folder (LEAF's sampled split, ``-t sample`` in its scripts:
every user holds samples in both). FedGroup (Duan et al., Sec. V-A, Table II)
and FedProx (Li et al. 2020) use these files; fedcluster does not download
them: users generate them with LEAF's own scripts (docs/datasets.md).

* ``leaf-femnist``: ``x`` is a row of 784 pixel values in [0, 1] (a 28x28 image,
  row-major), ``y`` a class 0..61 (digits, upper case, lower case). Inputs
  become ``[1, 28, 28]`` images. Option ``n_classes`` (default 62) sets the
  model's outputs: FedProx's FEMNIST (``data/nist/data/my_sample.py``: 200
  writers, lower-case a-j relabelled 0..9, three per writer), which FedGroup
  uses, feeds 26-output models (FedProx ``MODEL_PARAMS['nist.mclr'] = (26,)``;
  FedGroup Table II: MCLR 20,410 = 785·26, MLP 415,258 = 785·512 + 513·26).
* ``leaf-sent140``: ``x`` is LEAF's raw tweet record (a list whose fifth entry
  is the text) or the text itself, ``y`` is 0/1 (LEAF) or "0"/"4" (Sentiment140's
  own labels, 4 = positive). Texts are split into tokens as LEAF's
  ``line_to_indices`` does (words and the punctuation ``.,!?;``), lowercased, mapped
  to ids (0 = padding, 1 = unknown word) with a vocabulary built from the
  training texts (the ``vocab_size - 2`` most frequent tokens; ties by token) or
  read from ``vocab_file`` (one token per line), and padded/truncated to
  ``seq_len`` ids (25, FedProx's ``MODEL_PARAMS``). Inputs stay int64.

Clients are the users in file order (files sorted by name); client ``k``'s
samples are consecutive rows of the dataset's train and test pools
(``Dataset.client_sizes``/``test_client_sizes``), which the ``natural``
partition (:mod:`fedcluster.data.natural`) turns into the federation.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcluster.data.dataset import Dataset, Split
from fedcluster.errors import ConfigError, DataError

FEMNIST_CLASSES = tuple("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
SENT140_CLASSES = ("negative", "positive")
PAD_ID = 0
UNKNOWN_ID = 1
DEFAULT_SEQ_LEN = 25
DEFAULT_VOCAB_SIZE = 10_000
"""Token ids of ``leaf-sent140`` lie in ``[0, vocab_size)``; the ``lstm`` model's default
``vocab_size`` is the same number."""

LEAF_FOLDERS = {"leaf-femnist": "femnist", "leaf-sent140": "sent140"}
_TOKEN = re.compile(r"[\w']+|[.,!?;]")

UserData = dict[str, tuple[list[Any], list[Any], Path]]
"""user -> (x, y, the file that holds them)."""


def leaf_split_dirs(root: Path, name: str) -> tuple[Path, Path] | None:
    """The ``train/`` and ``test/`` folders of dataset ``name`` under ``root``, or None.

    Looked for as ``<root>/<folder>/{train,test}`` and, LEAF's own layout,
    ``<root>/<folder>/data/{train,test}`` (``folder``: ``femnist``, ``sent140``).
    """
    folder = root / LEAF_FOLDERS[name]
    for base in (folder, folder / "data"):
        train, test = base / "train", base / "test"
        if _json_files(train) and _json_files(test):
            return train, test
    return None


def missing_leaf_files(name: str) -> Any:
    """For the source registry: what ``root`` lacks for dataset ``name``."""
    folder = LEAF_FOLDERS[name]
    return lambda root: (
        []
        if leaf_split_dirs(root, name) is not None
        else [f"{folder}/train/*.json and {folder}/test/*.json (or {folder}/data/train, .../test)"]
    )


def _json_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def read_leaf_folder(folder: Path) -> UserData:
    """Every user's ``(x, y, file)`` from the ``*.json`` files of ``folder``, in file order.

    Raises:
        DataError: a file is not valid JSON or not in LEAF's format, or a user
            appears in two files; the message names the file and the user.
    """
    files = _json_files(folder)
    if not files:
        raise DataError(f"{folder}: no *.json files (LEAF's train/ or test/ folder expected)")
    users: UserData = {}
    for path in files:
        for user, x, y in _read_leaf_file(path):
            if user in users:
                raise DataError(f"{path}: user {user!r} also appears in {users[user][2]}")
            users[user] = (x, y, path)
    return users


def _read_leaf_file(path: Path) -> list[tuple[str, list[Any], list[Any]]]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a readable JSON file: {exc}") from exc
    except RecursionError:
        raise DataError(f"{path}: not a LEAF file: JSON nested too deeply") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("users"), list):
        raise DataError(f"{path}: not a LEAF file: no 'users' list")
    data = doc.get("user_data")
    if not isinstance(data, dict):
        raise DataError(f"{path}: not a LEAF file: no 'user_data' mapping")
    counts = doc.get("num_samples")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(doc["users"])):
        raise DataError(f"{path}: 'num_samples' must list one count per user")
    out = []
    for i, user in enumerate(doc["users"]):
        record = data.get(user) if isinstance(user, str) else None
        if not isinstance(record, dict):
            raise DataError(f"{path}: user {user!r} is listed in 'users' but has no 'user_data'")
        x, y = record.get("x"), record.get("y")
        if not isinstance(x, list) or not isinstance(y, list) or len(x) != len(y):
            raise DataError(f"{path}: user {user!r}: 'x' and 'y' must be lists of equal length")
        if counts is not None and counts[i] != len(y):
            raise DataError(
                f"{path}: user {user!r}: num_samples says {counts[i]} but it has {len(y)} samples"
            )
        out.append((user, x, y))
    return out


# --------------------------------------------------------------------------- FEMNIST


def femnist_arrays(
    users: UserData, n_classes: int = len(FEMNIST_CLASSES)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images ``[N, 1, 28, 28]`` float32, labels ``[N]`` int64, samples per user."""
    xs, ys = [], []
    for user, (x, y, path) in users.items():
        try:
            xa = np.asarray(x, dtype=np.float32).reshape(len(x), -1) if x else None
        except (TypeError, ValueError) as exc:
            raise DataError(f"{path}: user {user!r}: 'x' is not rows of numbers ({exc})") from exc
        if xa is not None and xa.shape[1] != 28 * 28:
            raise DataError(
                f"{path}: user {user!r}: a FEMNIST sample has 784 pixel values, got {xa.shape[1]}"
            )
        ya = _int_labels(y, n_classes, path, user)
        xs.append(np.zeros((0, 784), np.float32) if xa is None else xa)
        ys.append(ya)
    sizes = np.array([len(y) for y in ys], dtype=np.int64)
    images = (
        np.concatenate(xs).reshape(-1, 1, 28, 28) if xs else np.zeros((0, 1, 28, 28), np.float32)
    )
    labels = np.concatenate(ys) if ys else np.zeros(0, np.int64)
    return images, labels, sizes


def _int_labels(y: list[Any], n_classes: int, path: Path, user: str) -> np.ndarray:
    if any(isinstance(v, bool | str) for v in y):  # numpy would read '7' and True as numbers
        raise DataError(f"{path}: user {user!r}: labels 'y' must be numbers, not text or booleans")
    try:
        ya = np.asarray(y, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: user {user!r}: labels 'y' must be numbers ({exc})") from exc
    if ya.ndim != 1 or not np.all((ya == np.round(ya)) & (ya >= 0) & (ya < n_classes)):
        raise DataError(f"{path}: user {user!r}: labels must be integers 0..{n_classes - 1}")
    return ya.astype(np.int64)


# --------------------------------------------------------------------------- Sent140


def tokenize(text: str) -> list[str]:
    """LEAF's ``split_line``: words (with apostrophes) and ``.,!?;``, lowercased."""
    return _TOKEN.findall(text.lower())


def _tweet_text(x: Any, path: Path, user: str) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, list) and len(x) >= 5 and isinstance(x[4], str):
        return x[4]
    raise DataError(
        f"{path}: user {user!r}: a Sent140 sample is the tweet's text or LEAF's record "
        f"[id, date, query, user, text], got {str(x)[:60]}"
    )


def _sentiment(y: Any, path: Path, user: str) -> int:
    label = {0: 0, 1: 1, 4: 1, "0": 0, "1": 1, "4": 1}.get(y) if not isinstance(y, bool) else None
    if label is None:
        raise DataError(f"{path}: user {user!r}: a Sent140 label is 0/1 or '0'/'4', got {y!r}")
    return label


def build_vocabulary(texts: list[list[str]], vocab_size: int) -> dict[str, int]:
    """Token -> id for the ``vocab_size - 2`` most frequent tokens (ties: alphabetical)."""
    counts = Counter(token for tokens in texts for token in tokens)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[: vocab_size - 2]
    return {token: i + 2 for i, token in enumerate(ranked)}


def read_vocabulary(path: Path, vocab_size: int) -> dict[str, int]:
    """Token -> id from a file of one token per line (its first ``vocab_size - 2`` tokens)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read the vocabulary file: {exc}") from exc
    tokens = [line.strip().lower() for line in lines if line.strip()]
    if not tokens:
        raise DataError(f"{path}: the vocabulary file holds no tokens")
    vocab: dict[str, int] = {}
    for token in tokens:
        if len(vocab) == vocab_size - 2:
            break
        vocab.setdefault(token, len(vocab) + 2)
    return vocab


def encode(tokens: list[str], vocab: dict[str, int], seq_len: int) -> np.ndarray:
    """Token ids (unknown -> 1), truncated to ``seq_len`` and padded with 0 at the end."""
    ids = np.full(seq_len, PAD_ID, dtype=np.int64)
    head = [vocab.get(t, UNKNOWN_ID) for t in tokens[:seq_len]]
    ids[: len(head)] = head
    return ids


def sent140_texts(users: UserData) -> tuple[list[list[str]], np.ndarray, np.ndarray]:
    """Tokenised texts, labels ``[N]`` int64 and samples per user."""
    texts: list[list[str]] = []
    labels: list[int] = []
    sizes = []
    for user, (x, y, path) in users.items():
        texts += [tokenize(_tweet_text(xi, path, user)) for xi in x]
        labels += [_sentiment(yi, path, user) for yi in y]
        sizes.append(len(y))
    return texts, np.array(labels, dtype=np.int64), np.array(sizes, dtype=np.int64)


def _encode_all(texts: list[list[str]], vocab: dict[str, int], seq_len: int) -> np.ndarray:
    ids = np.zeros((len(texts), seq_len), dtype=np.int64)
    for i, tokens in enumerate(texts):
        ids[i] = encode(tokens, vocab, seq_len)
    return ids


# --------------------------------------------------------------------------- dataset


def _positive_int(name: str, option: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ConfigError(f"{name}: option {option} must be an integer >= {low}, got {value!r}")
    return int(value)


def load_leaf(name: str, root: Path, options: dict[str, Any]) -> Dataset:
    """The ``leaf-femnist`` / ``leaf-sent140`` :class:`~fedcluster.data.dataset.Dataset`.

    Raises:
        ConfigError: an unknown or bad option.
        DataError: the files are missing or malformed (the message names the file).
    """
    allowed = {
        "leaf-femnist": {"n_classes"},
        "leaf-sent140": {"seq_len", "vocab_size", "vocab_file"},
    }
    unknown = sorted(set(options) - allowed[name])
    if unknown:
        takes = ", ".join(sorted(allowed[name])) or "no options"
        raise ConfigError(f"{name}: unknown option(s) {', '.join(unknown)}; it takes {takes}")
    dirs = leaf_split_dirs(root, name)
    if dirs is None:
        raise DataError(f"{name}: {missing_leaf_files(name)(root)[0]} not found under {root}")
    train_users, test_users = (read_leaf_folder(d) for d in dirs)
    extra = [u for u in test_users if u not in train_users]
    if extra:
        raise DataError(
            f"{test_users[extra[0]][2]}: user {extra[0]!r} has test samples but no training "
            f"samples in {dirs[0]}"
        )
    test_users = {u: test_users.get(u, ([], [], dirs[1])) for u in train_users}
    if name == "leaf-femnist":
        n_classes = _positive_int(
            name, "n_classes", options.get("n_classes", len(FEMNIST_CLASSES)), 2
        )
        x_tr, y_tr, n_tr = femnist_arrays(train_users, n_classes)
        x_te, y_te, n_te = femnist_arrays(test_users, n_classes)
        classes = (
            FEMNIST_CLASSES
            if n_classes == len(FEMNIST_CLASSES)
            else tuple(str(c) for c in range(n_classes))
        )
    else:
        seq_len = _positive_int(name, "seq_len", options.get("seq_len", DEFAULT_SEQ_LEN), 1)
        vocab_size = _positive_int(
            name, "vocab_size", options.get("vocab_size", DEFAULT_VOCAB_SIZE), 3
        )
        texts_tr, y_tr, n_tr = sent140_texts(train_users)
        texts_te, y_te, n_te = sent140_texts(test_users)
        vocab_file = options.get("vocab_file")
        if vocab_file is None:
            vocab = build_vocabulary(texts_tr, vocab_size)
        else:
            vocab = read_vocabulary(Path(vocab_file).expanduser(), vocab_size)
        x_tr = _encode_all(texts_tr, vocab, seq_len)
        x_te = _encode_all(texts_te, vocab, seq_len)
        classes = SENT140_CLASSES
    return Dataset(
        name,
        Split(torch.from_numpy(np.ascontiguousarray(x_tr)), torch.from_numpy(y_tr)),
        Split(torch.from_numpy(np.ascontiguousarray(x_te)), torch.from_numpy(y_te)),
        classes,
        n_tr,
        test_client_sizes=n_te,
    )
