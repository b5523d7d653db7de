"""The loopback bucket's contents, generated once per size and reused (bench/README.md, "What happens" 1).

DATA/bench-bkt/big.bin is seeded-random bytes (the object every read row reads);
DATA/bench-bkt/tree/dNN/fNNNN.txt are 100 directories × 100 files of 1–4 KiB (the find and
ls -lR rows). fake-gcs-server loads DATA with `-data`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time

from . import MIB
from .host import log

BUCKET = "bench-bkt"
BIG = "big.bin"
SEED = 20240601
TREE_DIRS = 100
TREE_FILES_PER_DIR = 100
TREE_ENTRIES = 1 + TREE_DIRS + TREE_DIRS * TREE_FILES_PER_DIR  # what `find MNT/tree` prints


def prepare_data(root: str, size: int, fresh: bool) -> str:
    """DATA/BUCKET/{big.bin,tree/dNN/fNNNN.txt}, generated once per size, deterministic (seeded)."""
    marker = os.path.join(root, "READY.json")
    want = {"seed": SEED, "size": size, "dirs": TREE_DIRS, "files_per_dir": TREE_FILES_PER_DIR}
    if not fresh and os.path.exists(marker):
        try:
            with open(marker) as f:
                if json.load(f) == want:
                    log(f"re-using test data in {root}")
                    return root
        except (OSError, ValueError):
            pass
    if os.path.exists(root):
        shutil.rmtree(root)
    bdir = os.path.join(root, BUCKET)
    os.makedirs(bdir)
    t0 = time.monotonic()
    _write_big(os.path.join(bdir, BIG), size)
    n = _write_tree(bdir)
    with open(marker, "w") as f:
        json.dump(want, f)
    log(f"generated {size // MIB} MiB {BIG} + {n} tree files in {root} ({time.monotonic() - t0:.1f} s)")
    return root


def _write_big(path: str, size: int) -> None:
    rng = random.Random(SEED)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 16 * MIB)
            f.write(rng.randbytes(n))
            left -= n


def _write_tree(bdir: str) -> int:
    rng = random.Random(SEED + 1)
    n = 0
    for d in range(TREE_DIRS):
        dd = os.path.join(bdir, "tree", f"d{d:02d}")
        os.makedirs(dd)
        for _ in range(TREE_FILES_PER_DIR):
            with open(os.path.join(dd, f"f{n:04d}.txt"), "wb") as f:
                f.write(rng.randbytes(rng.randint(1024, 4096)))
            n += 1
    return n
