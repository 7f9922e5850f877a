"""Optional download of the file-based datasets, verified by SHA-256.

Every file is fetched with :mod:`urllib` (with a tqdm progress bar on stderr)
into a temporary file next to its
destination, hashed while it streams, and renamed into place only when its
SHA-256 is one of the digests listed here; otherwise the temporary file is
deleted and :class:`~fedcluster.errors.DataError` names the URL and both hashes.

Where files come from:

* by default, the official release (MNIST from PyTorch's S3 mirror of
  LeCun's files, Fashion-MNIST from Zalando's S3 bucket, CIFAR-10 from
  Toronto);
* with a mirror (argument ``mirror`` or environment variable
  ``FEDCLUSTER_MIRROR``: an ``http(s)://`` or ``file://`` URL, or a local
  folder), from ``<mirror>/<dataset folder>/<file name>``, i.e. a mirror is laid
  out like a data root (``shared/data`` works as one).

Accepted digests are those of the official files and of the copies in the
project's shared data folder, which were recompressed (MNIST, Fashion-MNIST),
partly rebuilt (MNIST training images) or re-encoded (CIFAR-10 as JPEG zip).
EMNIST's official release is a single 535 MB zip without a published SHA-256,
so EMNIST downloads only from a mirror; CIFAR-10 from a mirror is taken as the
official archive if the mirror has it, else as the JPEG zip.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from fedcluster.errors import DataError

ENV_MIRROR = "FEDCLUSTER_MIRROR"
EMNIST_OFFICIAL_URL = "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip"

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteFile:
    """One downloadable file.

    Attributes:
        path: location under the data root, and under a mirror's base URL.
        url: official URL, or None where the official release has no such file.
        sha256: accepted hex digests.
    """

    path: str
    url: str | None
    sha256: tuple[str, ...]


def _idx_files(
    folder: str, base_url: str, digests: dict[str, tuple[str, ...]]
) -> tuple[RemoteFile, ...]:
    return tuple(
        RemoteFile(f"{folder}/{name}", f"{base_url}{name}", sha) for name, sha in digests.items()
    )


_MNIST = _idx_files(
    "mnist",
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    {
        "train-images-idx3-ubyte.gz": (
            "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            "db8f937d487057fb14a9f0fbe97f0bc8d311ab41b750d41e1ff37c43b9e55e19",
        ),
        "train-labels-idx1-ubyte.gz": (
            "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            "51fc562b6747b666fbf6e84ce29d43c3cb5f9c388c664d43b33f02095313405a",
        ),
        "t10k-images-idx3-ubyte.gz": (
            "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            "cfeddb84311ecf044fc6a5b0f6ee8a24d265d4e83e388400186eb114082f4209",
        ),
        "t10k-labels-idx1-ubyte.gz": (
            "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
            "e41c74e484045d39b462a7790a4af51301bd9b0b24f0154798d713ec68c45920",
        ),
    },
)

_FASHION_MNIST = _idx_files(
    "fashion-mnist",
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    {
        "train-images-idx3-ubyte.gz": (
            "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
            "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
        ),
        "train-labels-idx1-ubyte.gz": (
            "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
            "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
        ),
        "t10k-images-idx3-ubyte.gz": (
            "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
            "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
        ),
        "t10k-labels-idx1-ubyte.gz": (
            "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
            "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
        ),
    },
)


def _emnist(split: str, images: str, labels: str, mapping: str) -> tuple[RemoteFile, ...]:
    stem = f"emnist/emnist-{split}"
    return (
        RemoteFile(f"{stem}-test-images-idx3-ubyte.gz", None, (images,)),
        RemoteFile(f"{stem}-test-labels-idx1-ubyte.gz", None, (labels,)),
        RemoteFile(f"{stem}-mapping.txt", None, (mapping,)),
    )


# Dataset name -> alternative file sets, tried in order; the first that downloads wins.
SOURCES: dict[str, tuple[tuple[RemoteFile, ...], ...]] = {
    "mnist": (_MNIST,),
    "fashion-mnist": (_FASHION_MNIST,),
    "emnist-bymerge": (
        _emnist(
            "bymerge",
            "36e3b5e25c383bc4c2657d6dee8213a4086866d7e39faf59a3392da13acbff47",
            "db143e1e99deaab6b5c8f538df24def2f97b60d95cdceb816d7c8007c2667ec2",
            "0b57cacbe7536ef91dd14bf1384f726f436dc619f026c03aa8c14a97e8730468",
        ),
    ),
    "emnist-byclass": (
        _emnist(
            "byclass",
            "829338a6d6d6cb8674cc0feced1552765cdce558a240fe45a7f27acc24d206a8",
            "be77f57402dad09426eab80be1636860aa8d43bb7badec4f5906b79d456c3ead",
            "ea02c181d813f1b49a6d220166b7097864d681f46ea87bbd8766db055debae71",
        ),
    ),
    "cifar10": (
        (
            RemoteFile(
                "cifar10/cifar-10-python.tar.gz",
                "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                ("6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",),
            ),
        ),
        (
            RemoteFile(
                "cifar10/cifar10-images.zip",
                None,
                ("3ebc0ec302d34b33a77bb2007327e721051dd01b23bf7d75e1a5c24fcd43b530",),
            ),
        ),
    ),
}


class _NotOnServer(Exception):
    """The server answered that a file does not exist (HTTP 404, missing file://)."""


def resolve_mirror(mirror: str | Path | None) -> str | None:
    """The mirror base URL: ``mirror`` > ``$FEDCLUSTER_MIRROR`` > None (official sources).

    A local folder is turned into a ``file://`` URL.
    """
    base = str(mirror) if mirror is not None else os.environ.get(ENV_MIRROR) or None
    if base is not None and "://" not in base:
        base = Path(base).expanduser().resolve().as_uri()
    return base.rstrip("/") if base is not None else None


def download_dataset(
    name: str, data_dir: Path, *, mirror: str | Path | None = None, timeout: float = 60.0
) -> list[Path]:
    """Download ``name``'s files into ``data_dir`` (a data root) and return their paths.

    Files already present are kept as they are. Alternatives (CIFAR-10: the
    official archive, else the JPEG zip) are tried in order; a file that the
    server does not have moves on to the next alternative.

    Raises:
        DataError: no alternative could be downloaded, a checksum does not match,
            the server or network failed, or ``data_dir`` is not writable.
    """
    if name not in SOURCES:
        raise DataError(f"{name}: no download source (downloadable: {', '.join(SOURCES)})")
    base = resolve_mirror(mirror)
    for files in SOURCES[name]:
        targets = [data_dir / f.path for f in files]
        if all(t.is_file() for t in targets):
            return targets
    tried = []
    for files in SOURCES[name]:
        given = [f.url if base is None else f"{base}/{f.path}" for f in files]
        urls = [url for url in given if url is not None]
        if len(urls) < len(given):
            tried.append(f"{files[0].path} (only available from a mirror)")
            continue
        try:
            for f, url in zip(files, urls, strict=True):
                target = data_dir / f.path
                if not target.is_file():
                    _fetch(url, target, f.sha256, timeout)
        except _NotOnServer as exc:
            tried.append(f"{exc} (not found)")
            continue
        return [data_dir / f.path for f in files]
    hint = f"set {ENV_MIRROR} to a mirror laid out like a data root"
    if name.startswith("emnist") and base is None:
        hint = (
            f"EMNIST is released as one zip ({EMNIST_OFFICIAL_URL}): unzip it and put "
            f"emnist-{name.split('-')[1]}-*.gz and the mapping file in {data_dir / 'emnist'}, "
            f"or {hint}"
        )
    raise DataError(f"{name}: nothing to download; tried {'; '.join(tried)}. {hint}")


def _fetch(url: str, target: Path, sha256: tuple[str, ...], timeout: float) -> None:
    """Download ``url`` to ``target`` atomically if its SHA-256 is in ``sha256``."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    except OSError as exc:
        raise DataError(f"{target}: cannot write the download ({exc})") from exc
    _log.info("downloading %s -> %s", url, target)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            size = resp.headers.get("Content-Length")
            with tqdm(
                total=int(size) if size and size.isdigit() else None,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=target.name,
                leave=False,
                dynamic_ncols=True,
            ) as bar:
                while chunk := resp.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
        got = digest.hexdigest()
        if got not in sha256:
            raise DataError(
                f"{url}: SHA-256 mismatch, got {got}, expected {' or '.join(sha256)}; "
                "the download was deleted"
            )
        os.replace(tmp, target)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise _NotOnServer(url) from exc
        raise DataError(f"{url}: HTTP error {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, FileNotFoundError):
            raise _NotOnServer(url) from exc
        raise DataError(f"{url}: download failed ({exc.reason})") from exc
    except OSError as exc:
        raise DataError(f"{url}: download to {target} failed ({exc})") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
