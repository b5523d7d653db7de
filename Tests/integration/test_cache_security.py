"""The cache directory as an attack surface (docs: "The cache directory").

Part A: a cache_dir another user could have made or redirected is refused before anything is
mounted, with one `storefs: ` line naming the offending path, and storefs changes nothing it
refused (no chmod, nothing created). A fresh cache_dir is created 0700 and works.

Part B: tampering inside an accepted cache_dir. A valid cache is made by a first mount, then
something is planted in it (links out of the directory, FIFOs, files of another user, blocks
whose CRCs were recomputed over wrong bytes), and the same cache_dir is mounted again. The
remount must come up within 20 s, every read must give the uploaded bytes (or EIO where
stated), and nothing outside the cache directory may change.

Runs as root; uid 65534 (nobody) plays "another user".
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import struct
import time

import pytest

from storefs_testlib import (BUCKET, Corpus, crc32c, is_mounted, pid_alive, pids_with_arg, read_whole,
                             run_storefs)

KiB, MiB = 1 << 10, 1 << 20
NOBODY = 65534
REMOUNT_LIMIT_S = 20.0
HELLO, LINES = "files/hello.txt", "files/lines.txt"
SMALL = [HELLO, LINES, Corpus.GZIP]




def test_crc32c_helper_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


# ====================================================================== cache files
class CacheFile:
    """One parsed `<64 hex>.blk` (layout in CacheFileFormat.swift)."""

    HEADER = 128
    ENTRY = 8

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            head = f.read(self.HEADER)
            assert len(head) == self.HEADER and head[:8] == b"STFSBLK\0", f"{path}: not a cache file"
            (self.version, self.block_size, self.object_size, self.generation) = \
                struct.unpack_from("<IIqq", head, 8)
            self.key_hash = head[32:64]
            (self.block_count, self.header_crc) = struct.unpack_from("<II", head, 64)
            raw = f.read(self.ENTRY * self.block_count)
        self.entries = [struct.unpack_from("<II", raw, self.ENTRY * i) for i in range(self.block_count)]
        end = self.HEADER + self.ENTRY * self.block_count
        self.data_offset = (end + 4095) // 4096 * 4096

    def block_range(self, i: int) -> tuple[int, int]:
        """(offset in the object, length) of block i."""
        start = i * self.block_size
        return start, min(self.block_size, self.object_size - start)

    def read_block(self, i: int) -> bytes:
        _, n = self.block_range(i)
        with open(self.path, "rb") as f:
            f.seek(self.data_offset + i * self.block_size)
            return f.read(n)

    def present(self) -> list[int]:
        return [i for i, (_crc, n) in enumerate(self.entries) if n != 0]

    def plant(self, i: int, planted: bytes) -> None:
        """Overwrites block i's bytes and gives its index entry a CRC that matches them."""
        _, n = self.block_range(i)
        assert len(planted) == n
        with open(self.path, "r+b") as f:
            f.seek(self.data_offset + i * self.block_size)
            f.write(planted)
            f.seek(self.HEADER + self.ENTRY * i)
            f.write(struct.pack("<II", crc32c(planted), n))
        self.entries[i] = (crc32c(planted), n)


def cache_blk_files(cache_dir: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(os.path.join(cache_dir, "v1")):
        out += [os.path.join(root, f) for f in files if f.endswith(".blk")]
    return out


def cache_file_of(cache_dir: str, corpus: Corpus, name: str) -> CacheFile:
    """The cache file of a corpus object (matched by object size and generation)."""
    size, gen = len(corpus.data[name]), int(corpus.resources[name]["generation"])
    found = []
    for p in cache_blk_files(cache_dir):
        cf = CacheFile(p)
        if cf.object_size == size and cf.generation == gen:
            found.append(cf)
    assert len(found) == 1, f"{len(found)} cache files for {name} under {cache_dir}: " \
                            f"{[c.path for c in found]}"
    cf = found[0]
    assert os.path.basename(cf.path) == cf.key_hash.hex() + ".blk"
    return cf


def planted_copy(data: bytes) -> bytes:
    """Same length, every byte different: bytes that must never come out of a read."""
    return bytes(b ^ 0x5A for b in data)


# ====================================================================== helpers
def pread_random(path: str, ranges) -> list[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return [os.pread(fd, n, off) for off, n in ranges]
    finally:
        os.close(fd)


def tree_state(root: str) -> dict[str, tuple]:
    """Everything observable about `root` and what lies under it, links never followed:
    type, mode, owner, size, and the bytes' SHA-256 (regular files) or the target (links)."""
    def one(p: str) -> tuple:
        st = os.lstat(p)
        kind = stat.S_IFMT(st.st_mode)
        extra = None
        if stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                extra = hashlib.sha256(f.read()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            extra = os.readlink(p)
        return (kind, oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid, st.st_size, extra)

    out = {".": one(root)}
    if stat.S_ISDIR(os.lstat(root).st_mode):
        for dirpath, dirs, files in os.walk(root, followlinks=False):
            for n in dirs + files:
                p = os.path.join(dirpath, n)
                out[os.path.relpath(p, root)] = one(p)
    return out


def diff_states(before: dict, after: dict) -> list[str]:
    out = [f"removed {k}" for k in before if k not in after]
    out += [f"created {k} {after[k]}" for k in after if k not in before]
    out += [f"changed {k}: {before[k]} -> {after[k]}" for k in before
            if k in after and before[k] != after[k]]
    return out


def outside_dir(mount, with_keep: bool = True) -> str:
    """A directory of ours outside any cache (0755) holding keep.txt (0644)."""
    d = mount.new_dir("outside")
    os.chmod(d, 0o755)
    if with_keep:
        keep = os.path.join(d, "keep.txt")
        with open(keep, "wb") as f:
            f.write(b"not a cache file: storefs must leave me alone\n")
        os.chmod(keep, 0o644)
    return d


def populate(mount, corpus) -> str:
    """A first mount reads the small objects whole and a few ranges of the 24 MiB one (which
    stays partly cached); returns the cache_dir once unmounted."""
    m = mount(BUCKET)
    for name in SMALL:
        assert read_whole(m.p(name)) == corpus.data[name], name
    big = corpus.data[Corpus.BIG]
    ranges = [(0, 64 * KiB), (5 * MiB + 3, 40 * KiB), (17 * MiB, 16 * KiB)]
    assert pread_random(m.p(Corpus.BIG), ranges) == [big[o:o + n] for o, n in ranges]
    assert mount.unmount(m) == []
    return m.cache_dir


def remount(mount, cache_dir: str, **kwargs):
    t0 = time.monotonic()
    m = mount(BUCKET, cache_dir=cache_dir, **kwargs)
    took = time.monotonic() - t0
    assert took <= REMOUNT_LIMIT_S, f"the remount took {took:.1f} s (limit {REMOUNT_LIMIT_S:.0f} s)"
    return m


def verify_reads(m, corpus) -> None:
    """Every populated object reads back exactly (the 24 MiB one whole, and at random)."""
    for name in SMALL + [Corpus.BIG]:
        got = read_whole(m.p(name))
        assert len(got) == len(corpus.data[name]), f"{name}: {len(got)} bytes"
        assert got == corpus.data[name], f"{name}: bytes differ from the uploaded object"
    big = corpus.data[Corpus.BIG]
    ranges = [(0, 64 * KiB), (5 * MiB, 80 * KiB), (17 * MiB + 1, 1000), (len(big) - 100, 100)]
    assert pread_random(m.p(Corpus.BIG), ranges) == [big[o:o + n] for o, n in ranges]


# ====================================================================== A. refused cache_dir
def _case_other_owner(mount):
    d = mount.new_dir("cache")
    os.chmod(d, 0o700)
    os.chown(d, NOBODY, NOBODY)
    return d, d, [d]


def _case_symlink(mount):
    real = mount.new_dir("realcache")
    os.chmod(real, 0o700)
    link = os.path.join(mount.new_dir("linkparent"), "cache")
    os.symlink(real, link)
    return link, link, [real, os.path.dirname(link)]


def _case_mode(mode):
    def make(mount):
        d = mount.new_dir("cache")
        os.chmod(d, mode)
        return d, d, [d]
    return make


def _case_v1_other_owner(mount):
    d = mount.new_dir("cache")
    os.chmod(d, 0o700)
    v1 = os.path.join(d, "v1")
    os.mkdir(v1, 0o700)
    os.chown(v1, NOBODY, NOBODY)
    return d, v1, [d]


def _case_parent_world_writable(mount):
    parent = mount.new_dir("wwparent")
    os.chmod(parent, 0o777)          # owned by root, no sticky bit
    return os.path.join(parent, "cache"), parent, [parent]


REFUSED = {
    "other_owner": _case_other_owner,
    "symlink": _case_symlink,
    "mode_0777": _case_mode(0o777),
    "mode_0770": _case_mode(0o770),
    "v1_other_owner": _case_v1_other_owner,
    "parent_0777_no_sticky": _case_parent_world_writable,
}


def _expect_refused(mount, cache_dir: str, offending: str, foreground: bool = True) -> None:
    mnt = mount.new_dir("mnt")
    argv, _ = mount.argv(BUCKET, mnt, endpoint=None, foreground=foreground, cache_dir=cache_dir)
    mount.adopt(mnt, cache_dir)   # teardown cleans up if storefs mounts anyway
    r = run_storefs(argv, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode != 0, f"exit 0 with cache_dir={cache_dir}; stderr={r.stderr!r}"
    assert not is_mounted(mnt), "mounted although the cache_dir was refused"
    assert len(lines) == 1 and lines[0].startswith("storefs: "), \
        f"stderr must be exactly one 'storefs: ' line, got {r.stderr!r}"
    assert offending in lines[0], f"the message does not name {offending}: {lines[0]!r}"
    time.sleep(0.2)
    assert [p for p in pids_with_arg(mnt) if pid_alive(p)] == [], "a storefs process lingers"
    assert not is_mounted(mnt)


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsafe_cache_dir_is_refused_and_left_unchanged(mount, case):
    cache_dir, offending, watched = REFUSED[case](mount)
    before = {w: tree_state(w) for w in watched}
    _expect_refused(mount, cache_dir, offending)
    for w in watched:
        changes = diff_states(before[w], tree_state(w))
        assert changes == [], f"storefs changed {w} although it refused it: {changes}"


def test_unsafe_cache_dir_is_refused_in_daemon_mode_too(mount):
    cache_dir, offending, watched = _case_mode(0o777)(mount)
    _expect_refused(mount, cache_dir, offending, foreground=False)
    assert stat.S_IMODE(os.lstat(cache_dir).st_mode) == 0o777, "storefs chmodded the cache_dir"
    assert os.listdir(cache_dir) == []


def test_tmp_itself_is_refused_and_keeps_mode_1777(mount):
    assert stat.S_IMODE(os.lstat("/tmp").st_mode) == 0o1777, "/tmp is not 1777 on this machine"
    v1_before = os.path.lexists("/tmp/v1")
    lock_before = os.path.lexists("/tmp/v1/.lock")
    try:
        _expect_refused(mount, "/tmp", "/tmp")
        st = os.lstat("/tmp")
        assert stat.S_IMODE(st.st_mode) == 0o1777 and st.st_uid == 0, \
            f"/tmp is now {oct(st.st_mode)} uid {st.st_uid}"
        assert os.path.lexists("/tmp/v1") == v1_before, "storefs created /tmp/v1"
        assert os.path.lexists("/tmp/v1/.lock") == lock_before
    finally:
        if not v1_before and os.path.isdir("/tmp/v1") and not os.path.islink("/tmp/v1"):
            shutil.rmtree("/tmp/v1", ignore_errors=True)   # only what this test let it make


def test_fresh_cache_dir_is_created_0700_and_works(mount, corpus):
    parent = mount.new_dir("parent")
    os.chmod(parent, 0o755)
    cache_dir = os.path.join(parent, "fresh")
    m = mount(BUCKET, cache_dir=cache_dir)
    assert read_whole(m.p(LINES)) == corpus.data[LINES]
    for d in (cache_dir, os.path.join(cache_dir, "v1")):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, \
            f"{d}: {oct(st.st_mode)}"
        assert st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.lstat(parent).st_mode) == 0o755
    assert mount.unmount(m) == []
    assert cache_blk_files(cache_dir), "the mount cached nothing in the fresh cache_dir"


# ====================================================================== B. tampering
def test_shard_directory_symlinked_outside(mount, corpus):
    cache_dir = populate(mount, corpus)
    cf = cache_file_of(cache_dir, corpus, LINES)
    shard = os.path.dirname(cf.path)
    out = outside_dir(mount)
    # A valid copy of the shard's cache file too: following the link would find it usable.
    shutil.copyfile(cf.path, os.path.join(out, os.path.basename(cf.path)))
    os.chmod(os.path.join(out, os.path.basename(cf.path)), 0o644)
    before = tree_state(out)
    shutil.rmtree(shard)
    os.symlink(out, shard)

    m = remount(mount, cache_dir)
    verify_reads(m, corpus)
    assert mount.unmount(m) == []
    keep = os.path.join(out, "keep.txt")
    assert os.path.isfile(keep) and stat.S_IMODE(os.lstat(keep).st_mode) == 0o644
    assert stat.S_IMODE(os.lstat(out).st_mode) == 0o755
    assert diff_states(before, tree_state(out)) == []


def test_cache_file_symlinked_to_outside_file(mount, corpus):
    cache_dir = populate(mount, corpus)
    cf = cache_file_of(cache_dir, corpus, Corpus.BIG)
    present = cf.present()
    assert 0 in present and len(present) < cf.block_count, "want block 0 cached, not all"
    out = outside_dir(mount, with_keep=False)
    target = os.path.join(out, "victim.bin")
    shutil.copyfile(cf.path, target)          # a valid cache file with a planted block 0 ...
    CacheFile(target).plant(0, planted_copy(cf.read_block(0)))
    os.chmod(target, 0o644)                   # ... and most blocks absent: a follower writes
    before = tree_state(out)
    os.unlink(cf.path)
    os.symlink(target, cf.path)

    m = remount(mount, cache_dir)
    big = corpus.data[Corpus.BIG]
    assert pread_random(m.p(Corpus.BIG), [(0, 16 * KiB)]) == [big[:16 * KiB]], \
        "block 0 came from the file the link points to"
    verify_reads(m, corpus)
    assert mount.unmount(m) == []
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o644
    assert diff_states(before, tree_state(out)) == []


def test_version_directory_symlinked_outside(mount, corpus):
    cache_dir = populate(mount, corpus)
    v1 = os.path.join(cache_dir, "v1")
    out = outside_dir(mount)
    # The old cache's contents (a partly cached 24 MiB object among them): a follower would
    # load them, write the 24 MiB object's missing blocks into them, and delete keep.txt.
    for entry in os.listdir(v1):
        src = os.path.join(v1, entry)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(out, entry), symlinks=True)
    before = tree_state(out)
    shutil.rmtree(v1)
    os.symlink(out, v1)

    m = remount(mount, cache_dir)
    verify_reads(m, corpus)
    assert mount.unmount(m) == []
    assert stat.S_IMODE(os.lstat(out).st_mode) == 0o755
    assert diff_states(before, tree_state(out)) == [], "storefs touched the link's target"


@pytest.mark.parametrize("where", ["blk", "lock", "shard"])
def test_fifo_in_the_cache_does_not_hang_the_mount(mount, corpus, where):
    cache_dir = populate(mount, corpus)
    cf = cache_file_of(cache_dir, corpus, LINES)
    if where == "blk":
        victim = cf.path
        os.unlink(victim)
    elif where == "lock":
        victim = os.path.join(cache_dir, "v1", ".lock")
        os.unlink(victim)
    else:
        victim = os.path.dirname(cf.path)
        shutil.rmtree(victim)
    os.mkfifo(victim, 0o600)

    m = remount(mount, cache_dir)
    verify_reads(m, corpus)
    assert mount.unmount(m) == []


@pytest.mark.parametrize("block_size", [None, "64K"], ids=["16K", "64K"])
def test_planted_block_with_valid_crc_is_never_served(mount, corpus, block_size):
    """Block 0 of a wholly cached object is overwritten and its index CRC recomputed: only
    the whole-object check (combined block CRCs vs. the object's crc32c) can tell."""
    options = [f"block_size={block_size}"] if block_size else []
    m = mount(BUCKET, options=options)
    data = corpus.data[LINES]
    assert read_whole(m.p(LINES)) == data
    assert mount.unmount(m) == []
    cf = cache_file_of(m.cache_dir, corpus, LINES)
    assert cf.present() == list(range(cf.block_count)), "the object is not wholly cached"
    for i in cf.present():                    # my CRC and offsets agree with storefs' own
        off, n = cf.block_range(i)
        assert cf.read_block(i) == data[off:off + n]
        assert cf.entries[i] == (crc32c(data[off:off + n]), n), f"index entry {i}"
    planted = data[:cf.block_range(0)[1]].upper()     # "LINE 00000\n..."
    assert planted != data[:len(planted)]
    cf.plant(0, planted)

    again = remount(mount, m.cache_dir, options=options)
    outcomes = []
    for attempt in range(2):
        try:
            got = read_whole(again.p(LINES))
        except OSError as exc:
            assert exc.errno == errno.EIO, f"read #{attempt}: {errno.errorcode.get(exc.errno)}"
            outcomes.append("EIO")
            continue
        assert b"LINE " not in got, f"read #{attempt} served the planted bytes"
        assert got == data, f"read #{attempt}: bytes differ from the uploaded object"
        outcomes.append("ok")
    assert again.proc.poll() is None, "storefs exited"


def _tampered_big_cache(mount, corpus) -> tuple[str, CacheFile, bytes]:
    """A cache whose 24 MiB object is partly cached, block 0 planted with a valid CRC (the
    whole-object check cannot apply: not every block is cached)."""
    cache_dir = populate(mount, corpus)
    cf = cache_file_of(cache_dir, corpus, Corpus.BIG)
    present = cf.present()
    assert 0 in present and len(present) < cf.block_count, "want block 0 cached, not all"
    planted = planted_copy(cf.read_block(0))
    cf.plant(0, planted)
    return cache_dir, cf, planted


def test_cache_file_of_another_user_is_not_served(mount, corpus):
    cache_dir, cf, planted = _tampered_big_cache(mount, corpus)
    os.chown(cf.path, NOBODY, NOBODY)
    with open(cf.path, "rb") as f:
        planted_sha = hashlib.sha256(f.read()).hexdigest()

    m = remount(mount, cache_dir)
    big = corpus.data[Corpus.BIG]
    got = pread_random(m.p(Corpus.BIG), [(0, 16 * KiB), (100, 1000)])
    assert got == [big[:16 * KiB], big[100:1100]], \
        "block 0 came from a cache file owned by uid 65534"
    verify_reads(m, corpus)
    assert mount.unmount(m) == []
    # Removing the foreign file (and caching afresh under its name) is fine; writing into it,
    # or keeping its planted block as ours, is not.
    if os.path.lexists(cf.path):
        st = os.lstat(cf.path)
        assert stat.S_ISREG(st.st_mode), f"{cf.path} is now {oct(st.st_mode)}"
        if st.st_uid == NOBODY:
            with open(cf.path, "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == planted_sha, \
                    "storefs wrote into a file of another user"
        else:
            assert st.st_uid == os.geteuid(), f"{cf.path} now owned by uid {st.st_uid}"
            fresh = CacheFile(cf.path)
            if 0 in fresh.present():
                assert fresh.read_block(0) != planted, "the planted block is in our cache now"


def test_hard_linked_cache_file_is_not_served_nor_written(mount, corpus):
    cache_dir, cf, planted = _tampered_big_cache(mount, corpus)
    out = outside_dir(mount, with_keep=False)
    target = os.path.join(out, "victim.bin")
    os.rename(cf.path, target)                 # same file system: a hard link can point here
    os.chmod(target, 0o644)
    os.link(target, cf.path)
    before = tree_state(out)

    m = remount(mount, cache_dir)
    big = corpus.data[Corpus.BIG]
    assert pread_random(m.p(Corpus.BIG), [(0, 16 * KiB)]) == [big[:16 * KiB]], \
        "block 0 came from a cache file with a second link outside the cache"
    verify_reads(m, corpus)
    assert mount.unmount(m) == []
    assert diff_states(before, tree_state(out)) == [], "storefs wrote through the hard link"
    st = os.lstat(target)
    assert stat.S_IMODE(st.st_mode) == 0o644 and st.st_uid == 0
