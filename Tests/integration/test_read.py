"""Reading through the mount: bytes, sizes, times, modes."""

import hashlib
import os
import random
import stat
import subprocess
import threading

from storefs_testlib import expected_tree, rfc3339_to_epoch


def test_small_files_read_byte_exact(mount, corpus):
    m = mount()
    for name in ["files/hello.txt", "files/lines.txt", "weird/visible.txt", "clash/inner.txt",
                 corpus.TOKEN, corpus.PLAIN, corpus.LONG_OK, *corpus.ODD]:
        with open(m.p(name), "rb") as f:
            assert f.read() == corpus.data[name], name
        assert os.stat(m.p(name)).st_size == len(corpus.data[name]), name


def test_zero_byte_object(mount, corpus):
    m = mount()
    st = os.stat(m.p(corpus.ZERO))
    assert stat.S_ISREG(st.st_mode) and st.st_size == 0
    with open(m.p(corpus.ZERO), "rb") as f:
        assert f.read() == b""
    fd = os.open(m.p(corpus.ZERO), os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == b""
        assert os.pread(fd, 10, 100) == b""
    finally:
        os.close(fd)


def test_big_file_cat_matches_source(mount, corpus):
    m = mount()
    path = m.p(corpus.BIG)
    assert os.stat(path).st_size == corpus.BIG_SIZE
    r = subprocess.run(["cat", path], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) == corpus.BIG_SIZE
    assert hashlib.sha256(r.stdout).hexdigest() == corpus.sha256(corpus.BIG)


def test_big_file_random_preads(mount, corpus):
    m = mount()
    data = corpus.data[corpus.BIG]
    size = len(data)
    rng = random.Random(7)
    cases = [(0, 1), (0, 4096), (size - 1, 1), (size - 10, 100), (size, 10), (size + 4096, 1),
             ((1 << 20) - 7, 14), ((4 << 20) - 1, 3 << 20), (12345, 1 << 20)]
    cases += [(rng.randrange(size), rng.choice([1, 512, 4096, 65536, 300_000, 2 << 20]))
              for _ in range(200)]
    fd = os.open(m.p(corpus.BIG), os.O_RDONLY)
    try:
        for off, n in cases:
            got = os.pread(fd, n, off)
            assert got == data[off:off + n], f"pread(off={off}, n={n}) differs"
    finally:
        os.close(fd)


def test_concurrent_readers_get_their_own_bytes(mount, corpus):
    m = mount()
    data = corpus.data[corpus.BIG]
    errors = []
    quarter = len(data) // 4

    def reader(i):
        try:
            with open(m.p(corpus.BIG), "rb", buffering=0) as f:
                f.seek(i * quarter)
                got = bytearray()
                while len(got) < quarter:
                    chunk = f.read(min(256 * 1024, quarter - len(got)))
                    if not chunk:
                        break
                    got += chunk
            if bytes(got) != data[i * quarter:(i + 1) * quarter]:
                errors.append(f"reader {i}: bytes differ")
        except Exception as exc:  # reported below
            errors.append(f"reader {i}: {exc!r}")

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert errors == []


def test_gzip_object_reads_as_stored_bytes(mount, corpus):
    m = mount()
    stored = corpus.data[corpus.GZIP]
    assert stored[:2] == b"\x1f\x8b"
    assert os.stat(m.p(corpus.GZIP)).st_size == len(stored)
    with open(m.p(corpus.GZIP), "rb") as f:
        assert f.read() == stored
    fd = os.open(m.p(corpus.GZIP), os.O_RDONLY)
    try:
        assert os.pread(fd, 50, 10) == stored[10:60]   # ranges count stored bytes
    finally:
        os.close(fd)


def test_mtime_is_object_updated_time(mount, corpus):
    m = mount()
    for name in ["files/hello.txt", corpus.BIG, corpus.ZERO, corpus.GZIP, "odd/what?.txt",
                 "dir1500/f0042.txt"]:
        want = rfc3339_to_epoch(corpus.resources[name]["updated"])
        got = os.stat(m.p(name)).st_mtime
        assert abs(got - want) < 1.0, f"{name}: st_mtime {got} vs updated {want}"


def test_default_modes_regular_0644_dirs_0755(mount, corpus):
    m = mount()
    root = os.stat(m.path)
    assert stat.S_ISDIR(root.st_mode) and stat.S_IMODE(root.st_mode) == 0o755
    for d in ["files", "odd", "empty", "implicit", "implicit/deep", "clash", "dir1500"]:
        st = os.stat(m.p(d))
        assert stat.S_ISDIR(st.st_mode), d
        assert stat.S_IMODE(st.st_mode) == 0o755, (d, oct(st.st_mode))
    for f in ["files/hello.txt", corpus.ZERO, corpus.BIG, "clash/inner.txt", "odd/a+b.txt"]:
        st = os.lstat(m.p(f))
        assert stat.S_ISREG(st.st_mode), f
        assert stat.S_IMODE(st.st_mode) == 0o644, (f, oct(st.st_mode))


def test_mode_and_owner_options(mount, corpus):
    m = mount(options=["file_mode=0440", "dir_mode=0750", "uid=1234", "gid=5678"])
    for d in ["", "files", "empty", "implicit/deep"]:
        st = os.stat(m.p(d) if d else m.path)
        assert stat.S_ISDIR(st.st_mode), d
        assert stat.S_IMODE(st.st_mode) == 0o750, (d, oct(st.st_mode))
        assert (st.st_uid, st.st_gid) == (1234, 5678), d
    for f in ["files/hello.txt", corpus.ZERO, "odd/with space.txt"]:
        st = os.stat(m.p(f))
        assert stat.S_ISREG(st.st_mode), f
        assert stat.S_IMODE(st.st_mode) == 0o440, (f, oct(st.st_mode))
        assert (st.st_uid, st.st_gid) == (1234, 5678), f
    with open(m.p("files/hello.txt"), "rb") as f:
        assert f.read() == corpus.data["files/hello.txt"]


def test_every_visible_file_size_matches(mount, corpus):
    """Walk the whole mount; every file is where the model says, with the object's size."""
    m = mount()
    dirs, files = expected_tree(corpus.data)
    seen = {}
    for top, dnames, fnames in os.walk(m.path):
        rel = os.path.relpath(top, m.path)
        rel = "" if rel == "." else rel
        for fn in fnames:
            seen[os.path.join(rel, fn) if rel else fn] = os.lstat(os.path.join(top, fn)).st_size
    assert set(seen) == set(files)
    for path, size in seen.items():
        assert size == len(corpus.data[files[path]]), path
