"""What storefs remembers about names, and when it asks again (README, "Namespace semantics";
docs/architecture.md, "Metadata memory").

- A path seen within `stat_ttl` is answered without a request even after the kernel forgot
  its inode (a path-keyed cache, bounded by `metadata_cache_size`).
- `negative_ttl` and `list_ttl` agree: a cached listing says "absent" for `negative_ttl` only.
- After an object is overwritten or deleted in the bucket, a new open sees what the bucket
  holds now (the first open may fail with ESTALE, never with mixed bytes), as gcsfuse's
  `stale_handle` and mountpoint-s3's etag tests expect.
- Firebase v0: `find` costs list requests only; sizes are fetched when something asks.

Objects live in a bucket of their own, `metadata-bucket` (other modules list the corpus
bucket exactly). Requests are counted by the `fault_proxy` fixture (no faults set).
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
import uuid

import pytest

from storefs_testlib import read_whole

MB = "metadata-bucket"


@pytest.fixture(scope="module")
def mbucket(emulator):
    emulator.create_bucket(MB, exist_ok=True)
    return emulator


def _fresh_name(prefix: str) -> str:
    return f"{prefix}/{uuid.uuid4().hex[:12]}"


def _drop_kernel_caches() -> None:
    """Dentries and inodes: the kernel FORGETs what it held (README: needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


def test_a_known_path_needs_no_request_after_the_kernel_forgot_it(mount, mbucket, fault_proxy):
    name = _fresh_name("known")
    mbucket.upload(MB, name, b"x" * 100)
    m = mount(MB, endpoint=fault_proxy.endpoint, options=["stat_ttl=600", "list_ttl=0"])
    assert os.stat(m.p(name)).st_size == 100
    _drop_kernel_caches()
    fault_proxy.reset()
    assert os.stat(m.p(name)).st_size == 100
    asked = [r for r in fault_proxy.requests() if (r.name or r.prefix or "").startswith(name)]
    assert asked == [], f"a path seen within stat_ttl was asked about again: {[r.path for r in asked]}"


def test_a_name_that_appears_is_visible_after_negative_ttl_under_a_cached_listing(mount, mbucket):
    d = _fresh_name("appear")
    mbucket.upload(MB, f"{d}/old.txt", b"old\n")
    m = mount(MB, options=["list_ttl=600", "stat_ttl=600", "negative_ttl=1"])
    assert os.listdir(m.p(d)) == ["old.txt"]          # the directory's listing is now cached
    with pytest.raises(FileNotFoundError):
        os.stat(m.p(d, "new.txt"))
    mbucket.upload(MB, f"{d}/new.txt", b"new!\n")
    time.sleep(1.3)
    assert os.stat(m.p(d, "new.txt")).st_size == 5, "a new name stayed hidden behind the cached listing"
    with open(m.p(d, "new.txt"), "rb") as f:
        assert f.read() == b"new!\n"


def _read_at(path: str, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _open_until_it_works(path: str, expect: bytes) -> list[str]:
    """The first open after an overwrite may fail (ESTALE); the second must read `expect`."""
    failures = []
    for _ in range(2):
        try:
            got = read_whole(path)
        except OSError as e:
            failures.append(errno.errorcode.get(e.errno, str(e.errno)))
            continue
        assert got == expect, "an open after the overwrite read bytes that are not the new object's"
        return failures
    pytest.fail(f"two opens after the overwrite both failed: {failures}")


def test_reopen_after_overwrite_reads_the_new_object(mount, mbucket):
    name = _fresh_name("overwrite")
    old = os.urandom(2 << 20)
    new = os.urandom(3 << 20)
    mbucket.upload(MB, name, old)
    # Default stat_ttl (60 s): only storefs noticing the overwrite can make the reopen work.
    m = mount(MB, options=["read_ahead=0", "whole_file=0"])
    assert _read_at(m.p(name), 0, 4096) == old[:4096]
    mbucket.upload(MB, name, new)
    # An uncached range of the old generation: the bucket no longer has it.
    with pytest.raises(OSError) as e:
        _read_at(m.p(name), (3 << 20) // 2, 4096)
    assert e.value.errno == errno.ESTALE, f"a read of a replaced object gave {e.value!r}"
    failures = _open_until_it_works(m.p(name), new)
    assert len(failures) <= 1
    assert os.stat(m.p(name)).st_size == len(new)


def test_reopen_after_delete_is_enoent(mount, mbucket):
    name = _fresh_name("delete")
    data = os.urandom(2 << 20)
    mbucket.upload(MB, name, data)
    m = mount(MB, options=["read_ahead=0", "whole_file=0"])
    assert _read_at(m.p(name), 0, 4096) == data[:4096]
    mbucket.delete(MB, name)
    with pytest.raises(OSError) as e:
        _read_at(m.p(name), (3 << 20) // 2 - (1 << 20), 4096)
    assert e.value.errno in (errno.ESTALE, errno.ENOENT), repr(e.value)
    with pytest.raises(FileNotFoundError):
        read_whole(m.p(name))
    with pytest.raises(FileNotFoundError):
        os.stat(m.p(name))


def test_an_open_handle_never_reads_the_new_object(mount, mbucket):
    name = _fresh_name("handle")
    old, new = os.urandom(2 << 20), os.urandom(2 << 20)
    mbucket.upload(MB, name, old)
    m = mount(MB, options=["read_ahead=0", "whole_file=0"])
    fd = os.open(m.p(name), os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == old[:4096]
        mbucket.upload(MB, name, new)
        for offset in (1 << 20, (1 << 20) + 65536):
            try:
                got = os.pread(fd, 4096, offset)
            except OSError as e:
                assert e.errno == errno.ESTALE, repr(e)
            else:
                assert got == old[offset:offset + 4096], "an open handle served another generation's bytes"
    finally:
        os.close(fd)


def test_v0_find_costs_list_requests_only(bare_mount, firebase, emulator):
    """Firebase v0 listings carry names only: `find` must not GET every object's metadata."""
    from test_firebase import FB, fb_mount
    d = _fresh_name("v0find")
    emulator.create_bucket(FB, exist_ok=True)
    for i in range(120):
        emulator.upload(FB, f"{d}/f{i:03d}.bin", b"y" * i)
    m = fb_mount(bare_mount, firebase)
    firebase.reset()
    out = subprocess.run(["find", m.p(d)], capture_output=True, text=True, check=True, timeout=60).stdout
    assert len(out.split("\n")) - 1 == 121
    assert firebase.settle()
    per_object = [r for r in firebase.requests("metadata") if (r.name or "").startswith(d + "/")]
    assert per_object == [], f"find made {len(per_object)} metadata GETs"
    # A stat asks for the size (and a few neighbours' in parallel), and the answer is right.
    assert os.stat(m.p(d, "f077.bin")).st_size == 77
    sizes = {n: os.stat(m.p(d, n)).st_size for n in sorted(os.listdir(m.p(d)))}
    assert sizes == {f"f{i:03d}.bin": i for i in range(120)}
    assert firebase.settle()
    gets = [r for r in firebase.requests("metadata") if (r.name or "").startswith(d + "/")]
    assert len(gets) <= 130, f"{len(gets)} metadata GETs for 120 stats"
