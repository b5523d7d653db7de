"""How long what storefs learnt stays true, through real mounts (issue 49, items 8 and 9;
gcsfuse's dentry-cache and stale-handle tests, ported).

- A name only looked up is trusted for `stat_ttl`, even when the lookup's answer came from
  its directory's first listing page (fetched beside it, cached for `list_ttl`): after
  `stat_ttl` an overwrite shows its new size and a delete makes the name go.
- A new generation opened beside a held-open old one gets another inode number (README,
  "Namespace semantics").

Objects live in `freshness-bucket`, each test under a directory of its own.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

FRB = "freshness-bucket"


@pytest.fixture(scope="module")
def frbucket(emulator):
    emulator.create_bucket(FRB, exist_ok=True)
    return emulator


def _fresh_dir(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def test_stat_after_stat_ttl_shows_an_overwrite_of_a_name_only_looked_up(mount, frbucket):
    d = _fresh_dir("overwrite")
    frbucket.upload(FRB, f"{d}/f.txt", b"x" * 10)
    frbucket.upload(FRB, f"{d}/other.txt", b"o")
    m = mount(FRB, options=["stat_ttl=2"])
    assert os.stat(m.p(d, "f.txt")).st_size == 10
    frbucket.upload(FRB, f"{d}/f.txt", b"y" * 25)
    time.sleep(2.1)
    assert os.stat(m.p(d, "f.txt")).st_size == 25, \
        "2.1 s after an overwrite, with stat_ttl=2, stat still shows the old size"


def test_stat_after_stat_ttl_of_a_deleted_name_only_looked_up_is_enoent(mount, frbucket):
    d = _fresh_dir("delete")
    frbucket.upload(FRB, f"{d}/f.txt", b"x" * 10)
    frbucket.upload(FRB, f"{d}/other.txt", b"o")
    m = mount(FRB, options=["stat_ttl=2"])
    assert os.stat(m.p(d, "f.txt")).st_size == 10
    frbucket.delete(FRB, f"{d}/f.txt")
    time.sleep(2.1)
    with pytest.raises(FileNotFoundError):
        os.stat(m.p(d, "f.txt"))


def test_a_new_generation_opened_beside_a_held_open_one_gets_another_inode(mount, frbucket):
    d = _fresh_dir("stale")
    old, new = b"old generation\n" * 100, b"new generation, longer\n" * 100
    frbucket.upload(FRB, f"{d}/f.txt", old)
    m = mount(FRB, options=["stat_ttl=0"])
    first = os.open(m.p(d, "f.txt"), os.O_RDONLY)
    try:
        st1 = os.fstat(first)
        assert st1.st_size == len(old)
        frbucket.upload(FRB, f"{d}/f.txt", new)
        second = os.open(m.p(d, "f.txt"), os.O_RDONLY)
        try:
            st2 = os.fstat(second)
            assert st2.st_ino != st1.st_ino, \
                f"both generations have inode {st1.st_ino} (sizes {st1.st_size}, {st2.st_size})"
            assert st2.st_size == len(new)
            assert os.pread(second, len(new) + 1, 0) == new
            assert os.fstat(first).st_ino == st1.st_ino
        finally:
            os.close(second)
    finally:
        os.close(first)
