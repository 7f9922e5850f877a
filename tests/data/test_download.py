"""Downloads from a local HTTP mirror: files land verified, tampered files are refused."""

from __future__ import annotations

import gzip
import hashlib
import shutil
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcluster.data import download
from fedcluster.data.download import RemoteFile, download_dataset, resolve_mirror
from fedcluster.data.sources import load_dataset
from fedcluster.errors import DataError

_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


@dataclass
class Mirror:
    folder: Path
    url: str
    requests: list[str] = field(default_factory=list)


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Mirror]:
    """An HTTP server on 127.0.0.1 serving ``tmp_path/mirror``, set as FEDCLUSTER_MIRROR.

    Paths containing ``broken`` answer HTTP 503.
    """
    folder = tmp_path / "mirror"
    folder.mkdir()
    requests: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, directory=str(folder), **kwargs)

        def do_GET(self) -> None:
            requests.append(self.path)
            if "broken" in self.path:
                self.send_error(503, "Service Unavailable")
            else:
                super().do_GET()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("FEDCLUSTER_MIRROR", url)
    for var in ("no_proxy", "NO_PROXY"):  # never send the local requests to a proxy
        monkeypatch.setenv(var, "127.0.0.1,localhost")
    try:
        yield Mirror(folder, url, requests)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".part")]


def _small_mnist(folder: Path) -> tuple[RemoteFile, ...]:
    """Small valid gzip IDX files in ``folder/mnist`` and their download entries."""
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte.gz": np.arange(12, dtype=np.uint8) % 10,
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte.gz": np.arange(5, dtype=np.uint8),
    }
    files = []
    for name, array in arrays.items():
        header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
        path = folder / "mnist" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(header + array.tobytes()))
        files.append(RemoteFile(f"mnist/{name}", None, (_sha256(path),)))
    return tuple(files)


# --------------------------------------------------------------------------- small files


def test_download_then_load(
    mirror: Mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(download.SOURCES, "mnist", (_small_mnist(mirror.folder),))
    root = tmp_path / "root"
    ds = load_dataset("mnist", root, download=True)
    assert ds.train.x.shape == (12, 1, 28, 28) and ds.test is not None
    assert ds.test.y.tolist() == [0, 1, 2, 3, 4]
    for name in _MNIST_FILES:
        assert _sha256(root / "mnist" / name) == _sha256(mirror.folder / "mnist" / name)
    assert sorted(mirror.requests) == sorted(f"/mnist/{n}" for n in _MNIST_FILES)
    assert not _leftovers(root)
    load_dataset("mnist", root, download=True)  # everything present: no request
    assert len(mirror.requests) == 4


def test_tampered_small_file(
    mirror: Mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _small_mnist(mirror.folder)
    monkeypatch.setitem(download.SOURCES, "mnist", (files,))
    served = mirror.folder / "mnist" / "t10k-labels-idx1-ubyte.gz"
    served.write_bytes(served.read_bytes() + b"\0")
    root = tmp_path / "root"
    with pytest.raises(DataError, match="SHA-256 mismatch") as info:
        download_dataset("mnist", root)
    message = str(info.value)
    assert f"{mirror.url}/mnist/t10k-labels-idx1-ubyte.gz" in message
    assert _sha256(served) in message and files[3].sha256[0] in message
    assert not (root / "mnist" / "t10k-labels-idx1-ubyte.gz").exists()
    assert not _leftovers(root)


def test_next_alternative_when_not_on_server(
    mirror: Mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    zipped = mirror.folder / "cifar10" / "cifar10-images.zip"
    zipped.parent.mkdir()
    zipped.write_bytes(b"pretend zip")
    alternatives = (
        (RemoteFile("cifar10/cifar-10-python.tar.gz", None, ("0" * 64,)),),
        (RemoteFile("cifar10/cifar10-images.zip", None, (_sha256(zipped),)),),
    )
    monkeypatch.setitem(download.SOURCES, "cifar10", alternatives)
    root = tmp_path / "root"
    assert download_dataset("cifar10", root) == [root / "cifar10" / "cifar10-images.zip"]
    assert mirror.requests == ["/cifar10/cifar-10-python.tar.gz", "/cifar10/cifar10-images.zip"]
    assert (root / "cifar10" / "cifar10-images.zip").read_bytes() == b"pretend zip"


def test_nothing_on_server(mirror: Mirror, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nothing to download") as info:
        download_dataset("fashion-mnist", tmp_path)
    assert f"{mirror.url}/fashion-mnist/train-images-idx3-ubyte.gz (not found)" in str(info.value)
    assert not _leftovers(tmp_path)


def test_server_error(mirror: Mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = RemoteFile("mnist/broken.gz", None, ("0" * 64,))
    monkeypatch.setitem(download.SOURCES, "mnist", ((entry,),))
    with pytest.raises(DataError, match="broken.gz: HTTP error 503"):
        download_dataset("mnist", tmp_path)
    assert not _leftovers(tmp_path)


def test_local_folder_as_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "mirror"
    monkeypatch.setitem(download.SOURCES, "mnist", (_small_mnist(folder),))
    root = tmp_path / "root"
    paths = download_dataset("mnist", root, mirror=folder)
    assert [p.name for p in paths] == list(_MNIST_FILES)
    monkeypatch.setenv("FEDCLUSTER_MIRROR", folder.as_uri())
    with pytest.raises(DataError, match="not found"):
        download_dataset("fashion-mnist", root)


def test_resolve_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDCLUSTER_MIRROR", raising=False)
    assert resolve_mirror(None) is None
    assert resolve_mirror("https://example.org/data/") == "https://example.org/data"
    assert resolve_mirror(tmp_path) == tmp_path.resolve().as_uri()
    monkeypatch.setenv("FEDCLUSTER_MIRROR", "http://127.0.0.1:9/x")
    assert resolve_mirror(None) == "http://127.0.0.1:9/x"
    assert resolve_mirror("http://other") == "http://other"


def test_emnist_needs_a_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDCLUSTER_MIRROR", raising=False)
    with pytest.raises(DataError, match="only available from a mirror") as info:
        download_dataset("emnist-byclass", tmp_path)
    assert download.EMNIST_OFFICIAL_URL in str(info.value)
    assert "FEDCLUSTER_MIRROR" in str(info.value)
    assert not (tmp_path / "emnist").exists()


def test_not_downloadable(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="digits: no download source"):
        download_dataset("digits", tmp_path)


# --------------------------------------------------------------------------- real files


def test_checksums_accept_the_shared_files(shared_data_dir: Path) -> None:
    checked = 0
    for alternatives in download.SOURCES.values():
        for files in alternatives:
            for f in files:
                path = shared_data_dir / f.path
                if path.is_file():
                    assert _sha256(path) in f.sha256, f.path
                    checked += 1
    assert checked >= 15


def test_download_real_mnist_from_mirror(
    shared_data_dir: Path, mirror: Mirror, tmp_path: Path
) -> None:
    shutil.copytree(shared_data_dir / "mnist", mirror.folder / "mnist")
    root = tmp_path / "root"
    ds = load_dataset("mnist", root, download=True)
    assert len(ds.train.y) == 60000 and ds.test is not None and len(ds.test.y) == 10000
    assert torch.bincount(ds.test.y).tolist()[:3] == [980, 1135, 1032]
    for name in _MNIST_FILES:
        assert _sha256(root / "mnist" / name) == _sha256(shared_data_dir / "mnist" / name)
    assert not _leftovers(root)


def test_tampered_real_file(shared_data_dir: Path, mirror: Mirror, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "mnist").mkdir(parents=True)
    for name in _MNIST_FILES[:3]:  # present already: kept, not fetched
        (root / "mnist" / name).symlink_to(shared_data_dir / "mnist" / name)
    name = _MNIST_FILES[3]
    data = bytearray((shared_data_dir / "mnist" / name).read_bytes())
    data[100] ^= 0xFF
    (mirror.folder / "mnist").mkdir()
    (mirror.folder / "mnist" / name).write_bytes(bytes(data))
    with pytest.raises(DataError) as info:
        load_dataset("mnist", root, download=True)
    message = str(info.value)
    assert f"{mirror.url}/mnist/{name}: SHA-256 mismatch" in message
    assert hashlib.sha256(bytes(data)).hexdigest() in message
    assert _sha256(shared_data_dir / "mnist" / name) in message  # an accepted digest
    assert mirror.requests == [f"/mnist/{name}"]
    assert not (root / "mnist" / name).exists()
    assert not _leftovers(root)
