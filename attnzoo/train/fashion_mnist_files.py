"""Fashion-MNIST's four files, checked against their known sizes and checksums, and a command that
copies them into the checkout (``data/`` is ignored by git) so that a machine without the Debian
package or a network (the GPU machine) gets them with the working tree:

    python -m attnzoo.train.fashion_mnist_files copy                  # Debian's files -> data/fashion-mnist
    python -m attnzoo.train.fashion_mnist_files copy --from DIR --to DEST
    python -m attnzoo.train.fashion_mnist_files check data/fashion-mnist

Two sets of the same data are known. The Debian package ``dataset-fashion-mnist``
(0.0~git20200523.55506a9-1, files in /usr/share/datasets/fashion-mnist/) recompressed the files:
their sizes and SHA-256 below were measured on that package's files. Zalando's own files (what
torchvision downloads) are known by the MD5 checksums torchvision lists
(``torchvision.datasets.FashionMNIST.resources``). A file passes when it is either."""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from .errors import DataChecksumError, DataNotFoundError

# where the Debian package dataset-fashion-mnist puts the files; ATTNZOO_FASHION_MNIST_DIR points
# elsewhere (tests use it to behave the same whether or not the package is installed)
DEBIAN_FOLDER = Path(os.environ.get("ATTNZOO_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
FASHION_MNIST_INSTALL = "sudo apt-get install dataset-fashion-mnist"
FASHION_FILES = {True: ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                 False: ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}

KNOWN = {  # name: (Debian file's size in bytes, Debian file's SHA-256, Zalando's file's MD5 as torchvision lists it)
    "train-images-idx3-ubyte.gz": (26421856, "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
                                   "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
    "train-labels-idx1-ubyte.gz": (29491, "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
                                   "25c81989df183df01b3e8a0aad5dffbe"),
    "t10k-images-idx3-ubyte.gz": (4422079, "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
                                  "bef4ecab320f06d8554ea6380940ec79"),
    "t10k-labels-idx1-ubyte.gz": (5125, "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
                                  "bb300cfdad3c16e7a12a480ee83cd310"),
}
NAMES = FASHION_FILES[True] + FASHION_FILES[False]
DEFAULT_DEST = Path("data") / "fashion-mnist"


def digests(path: Path) -> tuple[int, str, str]:
    """(size, SHA-256, MD5) of a file, read once."""
    sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
            md5.update(block)
            size += len(block)
    return size, sha.hexdigest(), md5.hexdigest()


def verify_file(path: Path) -> str:
    """Which known copy ``path`` is ("debian" or "zalando"); DataChecksumError naming the file and
    what was expected otherwise."""
    path = Path(path)
    if path.name not in KNOWN:
        raise ValueError(f"{path.name!r} is not a Fashion-MNIST file; expected one of {NAMES}")
    size, sha, md5 = digests(path)
    want_size, want_sha, want_md5 = KNOWN[path.name]
    if size == want_size and sha == want_sha:
        return "debian"
    if md5 == want_md5:
        return "zalando"
    raise DataChecksumError(
        f"{path} is not the Fashion-MNIST file it is named after ({size} bytes, SHA-256 {sha[:16]}..., MD5 {md5}); "
        f"expected the Debian package's ({want_size} bytes, SHA-256 {want_sha[:16]}...) or Zalando's (MD5 {want_md5}); "
        f"copy it again (python -m attnzoo.train.fashion_mnist_files copy), or set data.verify=false to use it anyway")


def verify_folder(folder: Path) -> dict:
    """{name: "debian" | "zalando"} for the four files in ``folder``; an error names the first bad one."""
    folder = Path(folder)
    missing = [n for n in NAMES if not (folder / n).is_file()]
    if missing:
        raise DataNotFoundError(f"{folder} lacks {missing}; copy the four Fashion-MNIST files there")
    return {n: verify_file(folder / n) for n in NAMES}


def copy_files(source: Optional[Path] = None, dest: Path = DEFAULT_DEST) -> dict:
    """Copy the four files from ``source`` (default: the Debian package's folder) to ``dest``,
    verifying them before and after."""
    source = Path(source) if source is not None else DEBIAN_FOLDER
    if not source.is_dir():
        raise DataNotFoundError(f"{source} does not exist; install the Debian package ({FASHION_MNIST_INSTALL}) "
                                f"or pass --from DIR holding the four .gz files")
    verify_folder(source)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        shutil.copyfile(source / name, dest / name)
    return verify_folder(dest)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnzoo.train.fashion_mnist_files",
                                description="copy or check Fashion-MNIST's four .gz files (sizes and checksums)")
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("copy", help="copy the files into the checkout (default: Debian's folder -> data/fashion-mnist)")
    c.add_argument("--from", dest="source", default=None, help=f"folder holding the files (default {DEBIAN_FOLDER})")
    c.add_argument("--to", dest="dest", default=str(DEFAULT_DEST), help=f"destination (default {DEFAULT_DEST})")
    k = sub.add_parser("check", help="check the four files in a folder")
    k.add_argument("folder")
    args = p.parse_args(argv)
    try:
        found = copy_files(args.source, Path(args.dest)) if args.action == "copy" else verify_folder(Path(args.folder))
    except DataNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = args.dest if args.action == "copy" else args.folder
    print(f"{where}: the four Fashion-MNIST files, verified ({', '.join(sorted(set(found.values())))} copy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
