"""statfs through a real mount (issue 49, item 5; mountpoint-s3's statfs test): the longest
name is 255 bytes, as names longer than that are hidden (README, "Namespace semantics")."""

from __future__ import annotations

import errno
import os

import pytest

SB = "statfs-bucket"
LONGEST = "n" * 255
TOO_LONG = "n" * 256


@pytest.fixture(scope="module")
def sbucket(emulator):
    emulator.create_bucket(SB, exist_ok=True)
    emulator.upload(SB, f"d/{LONGEST}", b"255\n")
    emulator.upload(SB, f"d/{TOO_LONG}", b"256\n")
    return emulator


def test_statfs_says_names_are_at_most_255_bytes_as_longer_ones_are_hidden(mount, sbucket):
    m = mount(SB)
    assert os.statvfs(m.path).f_namemax == 255, os.statvfs(m.path)
    assert os.pathconf(m.path, "PC_NAME_MAX") == 255
    assert os.listdir(m.p("d")) == [LONGEST], "the 256-byte name should be hidden, the 255-byte one shown"
    with open(m.p("d", LONGEST), "rb") as f:
        assert f.read() == b"255\n"
    with pytest.raises(OSError) as e:
        os.stat(m.p("d", TOO_LONG))
    assert e.value.errno == errno.ENAMETOOLONG, repr(e.value)
