"""Issue 43, the second audit: what the tools and `log_file=` do with a hostile bucket and a
hostile local user.

- `storefs prefetch` walks from a descriptor of the mount's root and never follows a link:
  a directory the bucket turns into a symlink after the walk, or a file system mounted inside
  the mount, is skipped with a notice, never opened (item 2).
- `log_file=` holds every ancestor to the cache directory's rules and reopens (SIGHUP) in the
  directory it first opened (item 6).
- `storefs cache clear` holds the cache's lock through its deletions (item 7).
- names printed by `prefetch` and `cache status` are escaped (item 8).

Objects live in `audit2-bucket`; each test uses names of its own. Another local user is a
throwaway account made for the test (`other_user`) and deleted after it.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

import pytest

from fault_proxy import FaultProxy
from storefs_testlib import run_storefs

AB = "audit2-bucket"
MiB = 1 << 20
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")   # all but \t and \n


@pytest.fixture(scope="module")
def abucket(emulator):
    emulator.create_bucket(AB, exist_ok=True)
    return emulator


@pytest.fixture
def other_user():
    """A throwaway unprivileged account: (name, uid, gid); deleted (with its home) after."""
    name = "sfa" + uuid.uuid4().hex[:8]
    r = subprocess.run(["useradd", "-m", "-s", "/usr/sbin/nologin", name], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"useradd {name} failed: {r.stderr.strip()} (these tests need root)", pytrace=False)
    try:
        import pwd
        pw = pwd.getpwnam(name)
        yield name, pw.pw_uid, pw.pw_gid
    finally:
        r = subprocess.run(["userdel", "-r", name], capture_output=True, text=True)
        assert r.returncode in (0, 12), f"userdel -r {name}: {r.stderr}"   # 12: no mail spool


@pytest.fixture
def shared_tmp():
    """A directory right under /tmp (whose ancestors another user can traverse, unlike
    tmp_path's); removed after the test."""
    d = tempfile.mkdtemp(prefix="storefs-audit2-", dir="/tmp")
    try:
        yield pathlib.Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        assert not os.path.exists(d), f"could not remove {d}"


def as_user(user, argv, **kw):
    _, uid, gid = user
    return subprocess.run(argv, user=uid, group=gid, extra_groups=[], capture_output=True, text=True,
                          timeout=30, **kw)


def prefetch(storefs_bin, *paths, timeout=60):
    return run_storefs([storefs_bin, "prefetch", *paths], timeout=timeout)


# ---------------------------------------------------------------- item 2: prefetch's walk

def test_prefetch_never_follows_a_directory_the_bucket_turned_into_a_link(mount, abucket, storefs_bin, tmp_path):
    """The bucket replaces race/sub (a directory at walk time) with a symlink object to a
    local directory holding FIFOs, while prefetch reads race/a.bin: opening race/sub/c.bin by
    path would follow the link and block on the FIFO forever."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for n in ("c.bin", "d.bin"):
        os.mkfifo(elsewhere / n)
    abucket.upload(AB, "race/a.bin", os.urandom(2 * MiB))
    abucket.upload(AB, "race/sub/c.bin", b"c" * 1000)
    abucket.upload(AB, "race/sub/d.bin", b"d" * 1000)
    slow = FaultProxy(abucket.http_endpoint, aliases=[abucket.endpoint]).start()
    p = None
    try:
        slow.add_rule(kind="media", name_prefix="race/a.bin", fault="delay", seconds=4)
        m = mount(AB, endpoint=slow.endpoint, options=["stat_ttl=0", "list_ttl=0", "negative_ttl=0"])
        p = subprocess.Popen([storefs_bin, "prefetch", "-j", "1", m.p("race")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 20
        while not any(r.kind == "media" and r.name == "race/a.bin" for r in slow.log):
            assert time.monotonic() < deadline and p.poll() is None, "prefetch never started reading race/a.bin"
            time.sleep(0.02)
        # The walk is done; the worker waits on race/a.bin. Now the directory becomes a link.
        abucket.delete(AB, "race/sub/c.bin")
        abucket.delete(AB, "race/sub/d.bin")
        abucket.upload(AB, "race/sub", b"", metadata={"gcsfuse_symlink_target": str(elsewhere)})
        assert os.readlink(m.p("race/sub")) == str(elsewhere), "the bucket's link is not visible: the test proves nothing"
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("prefetch hung: it followed race/sub, now a link, and opened a FIFO outside the mount")
        assert p.returncode == 0, err
        assert "1 of 3 files fetched" in err, err
        for n in ("c.bin", "d.bin"):
            assert f"skipped {m.p('race/sub/' + n)}: race/sub is a symbolic link now (not followed)" in err, err
    finally:
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        slow.stop()


def test_prefetch_skips_a_file_system_mounted_inside_the_mount(mount, abucket, storefs_bin, tmp_path):
    """A directory of another file system mounted over one of the mount's: its regular file
    is not read, its FIFO not opened; the mount's own files are."""
    abucket.upload(AB, "inside/own.bin", b"o" * 5000)
    abucket.upload(AB, "inside/over/hidden.bin", b"h" * 5000)
    local = tmp_path / "local"
    local.mkdir()
    (local / "local.txt").write_bytes(b"a local file\n")
    os.mkfifo(local / "pipe")
    m = mount(AB)
    over = m.p("inside/over")
    r = subprocess.run(["mount", "--bind", str(local), over], capture_output=True, text=True)
    assert r.returncode == 0, f"mount --bind {local} {over}: {r.stderr}"
    try:
        before = os.stat(local / "local.txt").st_atime_ns
        r = prefetch(storefs_bin, m.p("inside"))
        assert r.returncode == 0, r.stderr
        assert "1 of 1 files fetched" in r.stderr, f"a file of another file system was read:\n{r.stderr}"
        assert f"skipped {over}: on another file system" in r.stderr, r.stderr
        assert os.stat(local / "local.txt").st_atime_ns == before
    finally:
        subprocess.run(["umount", over], capture_output=True, timeout=30)
    assert not os.path.ismount(over)


def test_prefetch_refuses_a_path_whose_link_leads_out_of_the_mount(mount, abucket, storefs_bin, tmp_path):
    """A symlink object given as the argument: what it names is outside any storefs mount."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    abucket.upload(AB, "out/link", b"", metadata={"gcsfuse_symlink_target": str(fifo)})
    m = mount(AB)
    assert os.readlink(m.p("out/link")) == str(fifo)
    r = prefetch(storefs_bin, m.p("out/link"), timeout=20)
    assert r.returncode == 1, r.stderr
    assert f"could not fetch {m.p('out/link')}: not a file or directory inside a storefs mount" in r.stderr, r.stderr


def test_prefetch_takes_the_mount_root_and_paths_relative_to_a_directory_inside(mount, abucket, storefs_bin):
    """The walk starts at the mount's root whatever the argument's form: the root itself, or
    a relative path from a working directory inside the mount."""
    for n in ("forms/one.bin", "forms/deep/two.bin"):
        abucket.upload(AB, n, os.urandom(300_000))
    m = mount(AB, options=["cache_size=256M"])
    r = run_storefs([storefs_bin, "prefetch", "deep/two.bin", "."], cwd=m.p("forms"), timeout=60)
    assert r.returncode == 0, r.stderr
    # Every walk precedes the reads: deep/two.bin is listed by both arguments.
    assert "3 of 3 files fetched" in r.stderr, r.stderr
    assert int(os.getxattr(m.p("forms/one.bin"), "user.storefs.cached")) == 300_000
    assert int(os.getxattr(m.p("forms/deep/two.bin"), "user.storefs.cached")) == 300_000
    r = prefetch(storefs_bin, m.path)
    assert r.returncode == 0, r.stderr
    assert "could not fetch" not in r.stderr and "forms" not in r.stderr, r.stderr


# ---------------------------------------------------------------- item 8: names on the terminal

EVIL = "esc/evil\x1b]0;PWNED\x07\r\x1b[2Kname.bin"


def test_prefetch_escapes_object_names_it_prints(mount, abucket, storefs_bin):
    abucket.upload(AB, EVIL, b"x" * 100)
    denied = FaultProxy(abucket.http_endpoint, aliases=[abucket.endpoint]).start()
    try:
        denied.add_rule(kind="media", name_prefix="esc/", fault="status", status=403)
        m = mount(AB, endpoint=denied.endpoint)
        r = prefetch(storefs_bin, m.p("esc"))
        assert r.returncode == 1, r.stderr
        assert not CONTROL.search(r.stderr), f"a control character reached the terminal: {r.stderr!r}"
        failed = [l for l in r.stderr.splitlines() if "could not fetch" in l]
        assert len(failed) == 1, r.stderr
        assert "evil\\x1b]0;PWNED\\x07\\x0d\\x1b[2Kname.bin" in failed[0], failed
    finally:
        denied.stop()


def _hold_flock(user, path):
    """A process of `user` holding an exclusive flock on directory `path` until killed."""
    _, uid, gid = user
    p = subprocess.Popen(["python3", "-c", "import fcntl, os, sys, time\n"
                          "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
                          "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(120)\n", path],
                         user=uid, group=gid, extra_groups=[], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_cache_status_escapes_the_mount_point_another_user_wrote(storefs_bin, other_user, shared_tmp):
    """Another user's cache directory with a forged v1/.lock: a screen clear and a second
    'in use' line with a forged pid in the mount point."""
    os.chmod(shared_tmp, 0o1777)   # as /tmp is
    cache = shared_tmp / "theirs"
    forged = "/x\x1b[2J\x1b[H\r  in use:    by pid 1 mounted at /root"
    r = as_user(other_user, ["python3", "-c", "import json, os, sys\n"
                             "d = sys.argv[1]\nos.makedirs(d + '/v1', 0o700)\n"
                             "open(d + '/v1/.lock', 'w').write(json.dumps({'pid': 4242, 'mountpoint': sys.argv[2]}))\n",
                             str(cache), forged])
    assert r.returncode == 0, r.stderr
    holder = _hold_flock(other_user, str(cache))
    try:
        r = run_storefs([storefs_bin, "cache", "status", str(cache)])
        assert r.returncode == 0, r.stderr
        assert "by pid 4242 mounted at" in r.stdout, r.stdout
        assert not CONTROL.search(r.stdout), f"a control character reached the terminal: {r.stdout!r}"
        assert "mounted at /x\\x1b[2J\\x1b[H\\x0d  in use:" in r.stdout, r.stdout
    finally:
        holder.kill()
        holder.wait(timeout=10)


# ---------------------------------------------------------------- item 7: cache clear's lock

def _flock_holders(path) -> set[int]:
    """pids holding a flock on `path` (/proc/locks)."""
    st = os.stat(path)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    for line in open("/proc/locks"):
        f = line.split()
        if "->" in f:
            continue
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == ident:
            pids.add(int(f[4]))
    return pids


def _count_files(v1) -> int:
    return sum(len(os.listdir(os.path.join(v1, d))) for d in os.listdir(v1) if d != ".lock")


def test_cache_clear_holds_the_lock_through_its_deletions(storefs_bin, tmp_path):
    """A mount takes the cache's lock (flock on cache_dir) with LOCK_EX|LOCK_NB: while clear
    deletes, that lock must be clear's, or a mount starting then loses its files. Watched from
    outside in /proc/locks: no sample taken while files were being deleted may show clear
    without the lock."""
    cache = tmp_path / "cache"
    v1 = cache / "v1"
    v1.mkdir(parents=True, mode=0o700)
    os.chmod(cache, 0o700)
    total = 0
    for s in range(64):
        shard = v1 / f"{s:02x}"
        shard.mkdir(mode=0o700)
        for i in range(400):
            fd = os.open(shard / f"{s:02x}{i:062x}.blk", os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
            total += 1
    p = subprocess.Popen([storefs_bin, "cache", "clear", str(cache)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    violations, observed = [], 0
    try:
        while p.poll() is None:
            before = _count_files(v1)
            holders = _flock_holders(cache)
            after = _count_files(v1)
            if p.poll() is not None:
                break
            if before < total and after > 0:   # deleting, before and after the lock sample
                observed += 1
                if p.pid not in holders:
                    violations.append((before, after))
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    assert p.returncode == 0, err
    assert f"{total} cached objects" in out, out
    assert observed > 0, "no sample fell inside the deletions: the test proves nothing"
    assert not violations, (f"clear deleted without holding the cache's lock in {len(violations)} of "
                            f"{observed} samples (files left before/after: {violations[:3]})")


# ---------------------------------------------------------------- item 6: log_file=

def _mount_fails(mount, options):
    """Runs a daemonizing mount (it returns once mounted, or with the reason it did not);
    unmounts it if it did mount. Returns (result, whether it had mounted)."""
    mnt = mount.new_dir("mnt")
    argv, _ = mount.argv(AB, mnt, endpoint=None, options=options, foreground=False)
    try:
        r = run_storefs(argv, timeout=30)
        return r, os.path.ismount(mnt)
    finally:
        if os.path.ismount(mnt):
            mount.unmount(mount.adopt(mnt, ""))


def test_log_file_under_a_directory_another_user_owns_is_refused(mount, abucket, other_user, shared_tmp):
    """/tmp-like sticky directory; the other user owns `theirs/` and links `theirs/logs` to a
    directory of their choosing: root must not create its log there."""
    os.chmod(shared_tmp, 0o1777)
    chosen = shared_tmp / "chosen"
    chosen.mkdir()
    r = as_user(other_user, ["sh", "-c", 'mkdir -m 755 "$1/theirs" && ln -s "$2" "$1/theirs/logs"', "sh",
                             str(shared_tmp), str(chosen)])
    assert r.returncode == 0, r.stderr
    log = shared_tmp / "theirs" / "logs" / "storefs.log"
    r, mounted = _mount_fails(mount, [f"log_file={log}"])
    assert not mounted and r.returncode != 0, "mounted with a log under another user's directory"
    assert f"its parent {shared_tmp}/theirs is owned by uid {other_user[1]}, not by root or uid 0" in r.stderr, r.stderr
    assert not (chosen / "storefs.log").exists()


def test_log_file_through_a_link_another_user_owns_is_refused(mount, abucket, other_user, shared_tmp):
    """The link itself, in a sticky directory, belongs to the other user."""
    os.chmod(shared_tmp, 0o1777)
    chosen = shared_tmp / "chosen"
    chosen.mkdir()
    r = as_user(other_user, ["ln", "-s", str(chosen), str(shared_tmp / "logs")])
    assert r.returncode == 0, r.stderr
    log = shared_tmp / "logs" / "storefs.log"
    r, mounted = _mount_fails(mount, [f"log_file={log}"])
    assert not mounted and r.returncode != 0, "mounted with a log reached through another user's link"
    assert f"{shared_tmp}/logs is a symbolic link owned by uid {other_user[1]}" in r.stderr, r.stderr
    assert not (chosen / "storefs.log").exists()


def test_sighup_reopens_the_log_in_the_directory_it_was_opened_in(mount, abucket, tmp_path):
    """log_file= reached through a link (root's own, so allowed); the link is re-pointed to a
    directory holding a root file of the same name before SIGHUP: that file is not touched."""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    other.mkdir()
    victim = other / "storefs.log"
    victim.write_bytes(b"root's own file\n")
    os.chmod(victim, 0o600)
    link = tmp_path / "current"
    os.symlink(first, link)
    m = mount(AB, options=[f"log_file={link}/storefs.log"])
    log = first / "storefs.log"
    deadline = time.monotonic() + 10
    while "mounted" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    os.rename(log, first / "storefs.log.1")        # logrotate
    os.unlink(link)
    os.symlink(other, link)                        # the link now names `other`
    os.kill(m.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while not (log.exists() and "log file reopened" in log.read_text()):
        if "log file reopened" in victim.read_text():
            break
        assert time.monotonic() < deadline, (os.listdir(first), victim.read_text())
        time.sleep(0.05)
    assert victim.read_bytes() == b"root's own file\n", "SIGHUP made storefs append to the file the link names now"
    assert "log file reopened" in log.read_text()
    assert os.path.ismount(m.path) and m.proc.poll() is None
