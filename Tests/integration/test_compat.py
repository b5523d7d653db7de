"""What other tools store in a bucket, shown as they meant it (README, "Compatibility"):
gcsfuse's symbolic links (both forms gcsfuse reads: the target in `gcsfuse_symlink_target`,
and `goog-reserved-file-is-symlink: true` with the target as the object's bytes), and the
POSIX metadata of `gsutil -P` / `gcloud storage cp --preserve-posix` uploads.

Objects live in `compat-bucket`.
"""

from __future__ import annotations

import os
import stat

import pytest

CB = "compat-bucket"
TARGET = "../data/target.txt"
FILES = {
    "data/target.txt": (b"the target\n", None),
    "links/legacy": (b"", {"gcsfuse_symlink_target": TARGET}),
    "links/standard": (TARGET.encode(), {"goog-reserved-file-is-symlink": "true"}),
    "links/not-a-link": (b"plain\n", {"goog-reserved-file-is-symlink": "false"}),
    "posix/script.sh": (b"#!/bin/sh\necho hi\n", {"goog-reserved-posix-mode": "100755",
                                                  "goog-reserved-posix-uid": "1234",
                                                  "goog-reserved-posix-gid": "2345"}),
    "posix/private.txt": (b"secret\n", {"goog-reserved-posix-mode": "600"}),
    "posix/plain.txt": (b"plain\n", None),
}


@pytest.fixture(scope="module")
def cbucket(emulator):
    emulator.create_bucket(CB, exist_ok=True)
    for name, (data, meta) in FILES.items():
        emulator.upload(CB, name, data, metadata=meta)
    return emulator


@pytest.mark.parametrize("link", ["links/legacy", "links/standard"])
def test_gcsfuse_symlinks_are_symlinks(mount, cbucket, link):
    m = mount(CB)
    st = os.lstat(m.p(link))
    assert stat.S_ISLNK(st.st_mode), oct(st.st_mode)
    assert st.st_size == len(TARGET)
    assert os.readlink(m.p(link)) == TARGET
    with open(m.p(link), "rb") as f:                      # the kernel follows it
        assert f.read() == b"the target\n"
    kinds = {e.name: e.is_symlink() for e in os.scandir(m.p("links"))}
    assert kinds == {"legacy": True, "standard": True, "not-a-link": False}


def test_symlinks_off_shows_the_objects_as_files(mount, cbucket):
    m = mount(CB, options=["symlinks=off"])
    for link, (data, _) in FILES.items():
        if link.startswith("links/"):
            st = os.lstat(m.p(link))
            assert stat.S_ISREG(st.st_mode) and st.st_size == len(data), link
            with open(m.p(link), "rb") as f:
                assert f.read() == data


def test_posix_modes_and_owners_are_honoured(mount, cbucket):
    m = mount(CB)
    script, private, plain = (os.stat(m.p(n)) for n in ("posix/script.sh", "posix/private.txt", "posix/plain.txt"))
    assert stat.S_IMODE(script.st_mode) == 0o755 and stat.S_IMODE(private.st_mode) == 0o600
    assert stat.S_IMODE(plain.st_mode) == 0o644          # no metadata: file_mode's default
    assert (script.st_uid, script.st_gid) == (1234, 2345), "root mounts show the uploader's owner"
    assert (plain.st_uid, plain.st_gid) == (os.getuid(), os.getgid())


def test_explicit_options_win_over_posix_metadata(mount, cbucket):
    m = mount(CB, options=["file_mode=0644", "uid=0", "gid=0"])
    script, private = os.stat(m.p("posix/script.sh")), os.stat(m.p("posix/private.txt"))
    assert stat.S_IMODE(script.st_mode) == 0o644, "file_mode= masks the stored mode"
    assert stat.S_IMODE(private.st_mode) == 0o600
    assert (script.st_uid, script.st_gid) == (0, 0)


def test_posix_metadata_off(mount, cbucket):
    m = mount(CB, options=["posix_metadata=off"])
    script = os.stat(m.p("posix/script.sh"))
    assert stat.S_IMODE(script.st_mode) == 0o644 and script.st_uid == os.getuid()
