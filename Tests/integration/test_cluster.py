"""Issue 47: storefs on a cluster, where the mount is made by another process.

- `storefs SOURCE /dev/fd/N` serves a FUSE connection that a privileged process opened and
  mounted with mount(2) `fd=N` (the CSI/sidecar pattern): storefs runs as a throwaway
  unprivileged user with the descriptor inherited, reads come through byte for byte, and
  storefs exits 0 once the mounter unmounts. A bad /dev/fd/N is one line before daemonizing.
- packaging/container/storefs-fdpass, the two halves of the sidecar example in
  packaging/kubernetes/: a root `mount` half that hands the connection over a Unix socket
  (SCM_RIGHTS) and an unprivileged `receive` half that runs storefs on /dev/fd/3.

Everything is real: mount(2) through ctypes (what a CSI node plugin does), fake-gcs-server over
TLS (the throwaway user reads a copy of the session CA), mounts cleaned up by path and
processes stopped by pid, whatever happens.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from storefs_testlib import (BUCKET, EXIT_TIMEOUT_S, MOUNT_TIMEOUT_S, expected_tree, fuse_mount,
                             is_mounted, metrics_over_unix, mount_at, pid_alive, pids_with_arg,
                             read_whole, throwaway_user, wait_for, wait_pid_gone)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FDPASS = os.path.join(ROOT, "packaging", "container", "storefs-fdpass")


# ---------------------------------------------------------------- helpers and fixtures
def unmount_all(path: str) -> None:
    while is_mounted(path):
        if subprocess.run(["umount", "-l", path], capture_output=True, timeout=30).returncode != 0:
            break


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def worker():
    """A throwaway system user with no home and no shell, storefs's unprivileged account:
    (name, uid, gid); its processes are killed by pid and the user removed at teardown."""
    with throwaway_user("sfclu", "these tests run storefs as") as user:
        yield user


class Place:
    """A root-owned 0755 directory in /tmp the worker can reach (pytest's tmp_path is 0700):
    `mnt` (root's, the mount point), `cache` (the worker's, 0700), `ca` (a 0644 copy of the
    session CA), `log` (storefs's stderr)."""

    def __init__(self, top: str, worker, ca_file: str) -> None:
        _, uid, gid = worker
        self.top = top
        self.mnt = os.path.join(top, "mnt")
        os.mkdir(self.mnt)
        self.cache = os.path.join(top, "cache")
        os.mkdir(self.cache, 0o700)
        os.chown(self.cache, uid, gid)
        self.ca = os.path.join(top, "ca.pem")
        shutil.copyfile(ca_file, self.ca)
        os.chmod(self.ca, 0o644)
        self.log = os.path.join(top, "storefs.log")

    def stderr(self) -> str:
        try:
            with open(self.log, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


@pytest.fixture
def place(worker, tls):
    top = tempfile.mkdtemp(prefix="storefs-cluster-", dir="/tmp")
    os.chmod(top, 0o755)
    p = Place(top, worker, tls.ca_file)
    try:
        yield p
    finally:
        unmount_all(p.mnt)
        shutil.rmtree(top, ignore_errors=True)


def storefs_argv(storefs_bin: str, emulator, place: Place, mountpoint: str, *extra: str) -> list[str]:
    options = [f"endpoint={emulator.endpoint}", "anonymous", f"ca_file={place.ca}",
               f"cache_dir={place.cache}", *extra]
    return [storefs_bin, "-f", "-o", ",".join(options), BUCKET, mountpoint]


def as_worker(worker, argv, place: Place, **kw) -> subprocess.Popen:
    _, uid, gid = worker
    with open(place.log, "ab") as log:
        return subprocess.Popen(argv, user=uid, group=gid, extra_groups=[], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True, **kw)


def wait_served(mnt: str, proc: subprocess.Popen, place: Place) -> None:
    """Until the root directory lists through the mount (FUSE_INIT answered)."""
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"storefs exited {proc.returncode} before serving the mount:\n{place.stderr()}",
                        pytrace=False)
        try:
            if os.listdir(mnt):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the mount at {mnt} was not served within {MOUNT_TIMEOUT_S:.0f} s:\n{place.stderr()}",
                        pytrace=False)
        time.sleep(0.05)


def check_corpus(mnt: str, corpus) -> int:
    """Every visible file of the corpus, byte for byte, and the root listing; returns bytes read."""
    dirs, files = expected_tree(corpus.data)
    assert set(os.listdir(mnt)) == dirs[""]
    total = 0
    for rel, name in sorted(files.items()):
        got = read_whole(os.path.join(mnt, rel))
        assert got == corpus.data[name], f"{rel}: {len(got)} bytes differ from the bucket's {len(corpus.data[name])}"
        total += len(got)
    return total


# ---------------------------------------------------------------- storefs SOURCE /dev/fd/N
def test_dev_fd_serves_a_connection_another_process_mounted_and_exits_0_on_unmount(
        storefs_bin, emulator, corpus, worker, place):
    _, uid, gid = worker
    fd = fuse_mount(place.mnt, uid, gid)
    metrics = os.path.join(place.cache, "metrics.sock")
    proc = None
    try:
        proc = as_worker(worker, storefs_argv(storefs_bin, emulator, place, f"/dev/fd/{fd}",
                                              f"metrics=unix:{metrics}"), place, pass_fds=(fd,))
        os.close(fd)   # storefs holds the only descriptor of the connection now
        fd = -1
        wait_served(place.mnt, proc, place)
        total = check_corpus(place.mnt, corpus)
        assert total >= corpus.BIG_SIZE
        # Every other option as usual: the cache is the one given, metrics are served.
        assert os.path.isdir(os.path.join(place.cache, "v1")), os.listdir(place.cache)
        answer = metrics_over_unix(metrics)
        assert answer.startswith(b"HTTP/1.1 200") and b"storefs_fuse_read_bytes_total" in answer, answer[:300]
        entry = mount_at(place.mnt)
        assert entry is not None and entry[1] == "fuse.storefs", entry
        # The mounter unmounts: the connection ends and storefs exits 0.
        r = subprocess.run(["umount", place.mnt], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        try:
            rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"storefs still running {EXIT_TIMEOUT_S:.0f} s after the unmount:\n{place.stderr()}")
        assert rc == 0, place.stderr()
        assert "level=error" not in place.stderr(), place.stderr()
    finally:
        if fd >= 0:
            os.close(fd)
        unmount_all(place.mnt)
        stop(proc)


def test_dev_fd_as_root_daemonizes_raises_the_read_ahead_and_warns_of_ignored_mount_options(
        storefs_bin, emulator, corpus, place):
    """Without -f storefs returns once it serves the connection and the daemon keeps it. No
    mount point to look up in /proc/self/mountinfo: the connection's device, from
    /proc/self/fdinfo/N, names the bdi whose read_ahead_kb storefs raises to 1024. A mount
    option given to storefs is the mounter's to choose: ignored, with a warning."""
    os.chown(place.cache, 0, 0)   # root's storefs: root's cache
    fd = fuse_mount(place.mnt, 0, 0)
    entry_dev = [l.split(" ")[2] for l in open("/proc/self/mountinfo") if l.split(" ")[4] == place.mnt][-1]
    bdi = f"/sys/class/bdi/{entry_dev}/read_ahead_kb"
    with open(bdi) as f:
        before = f.read().strip()
    assert before != "1024", f"{bdi} is already 1024: the test proves nothing"
    daemon = None
    try:
        argv = storefs_argv(storefs_bin, emulator, place, f"/dev/fd/{fd}", "allow_other", "log_file=" + place.log)
        argv.remove("-f")
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                           pass_fds=(fd,))
        os.close(fd)
        fd = -1
        assert r.returncode == 0, r.stderr
        warning = [l for l in place.stderr().splitlines() if "mount options are the mounter's with /dev/fd/N" in l]
        assert len(warning) == 1 and "ignored=allow_other" in warning[0], place.stderr()
        daemons = [p for p in pids_with_arg(argv[-1]) if pid_alive(p)]
        assert len(daemons) == 1, daemons
        daemon = daemons[0]
        assert read_whole(os.path.join(place.mnt, "files/hello.txt")) == corpus.data["files/hello.txt"]
        with open(bdi) as f:
            assert f.read().strip() == "1024", f"{bdi} not raised\n{place.stderr()}"
        assert subprocess.run(["umount", place.mnt], capture_output=True, timeout=30).returncode == 0
        assert wait_pid_gone(daemon, EXIT_TIMEOUT_S), f"the daemon outlived the unmount:\n{place.stderr()}"
        daemon = None
        assert "level=error" not in place.stderr(), place.stderr()
    finally:
        if fd >= 0:
            os.close(fd)
        unmount_all(place.mnt)
        if daemon is not None and pid_alive(daemon):
            os.kill(daemon, signal.SIGKILL)


BAD_DESCRIPTORS = {
    # case -> (how the descriptor is made, words the one line must have)
    "not-open": (None, "is not an open descriptor of this process"),
    "regular-file": ("file", "is not /dev/fuse"),
    "dev-null": ("/dev/null", "is not /dev/fuse (it is /dev/null)"),
    "fuse-not-mounted": ("/dev/fuse", "no mount uses it"),
    "fuse-read-only": ("/dev/fuse:ro", "read-only or write-only"),
    "stdout": (1, "descriptors 0-2"),
}


@pytest.mark.parametrize("case", sorted(BAD_DESCRIPTORS))
def test_dev_fd_refuses_a_bad_descriptor_with_one_line_before_daemonizing(
        storefs_bin, emulator, place, tmp_path, case):
    how, words = BAD_DESCRIPTORS[case]
    fd = -1
    if how is None:
        n = 200
        while True:   # a number nothing here has open
            try:
                os.fstat(n)
                n += 1
            except OSError:
                break
    elif isinstance(how, int):
        n = how
    else:
        path, _, mode = how.partition(":")
        if path == "file":
            path = str(tmp_path / "plain")
            open(path, "w").close()
        fd = os.open(path, os.O_RDONLY if mode == "ro" else os.O_RDWR)
        n = fd
    try:
        argv = storefs_argv(storefs_bin, emulator, place, f"/dev/fd/{n}")
        argv.remove("-f")   # a success would daemonize: the refusal must come first
        before = set(os.listdir("/proc"))
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                           pass_fds=(fd,) if fd >= 0 else ())
    finally:
        if fd >= 0:
            os.close(fd)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0, f"storefs accepted /dev/fd/{n} ({case}): {r.stderr}"
    assert len(lines) == 1, f"want one line saying what is wrong, got:\n{r.stderr}"
    assert lines[0].startswith(f"storefs: /dev/fd/{n}") and words in lines[0], lines[0]
    assert "mount -t fuse.storefs -o fd=" in lines[0], f"the line does not say how to fix it: {lines[0]}"
    leftovers = [p for p in set(os.listdir("/proc")) - before if p.isdigit()
                 and pid_alive(int(p)) and f"/dev/fd/{n}".encode() in open(f"/proc/{p}/cmdline", "rb").read()]
    assert not leftovers, f"a daemon was left running: {leftovers}"
    assert not is_mounted(place.mnt)


# ---------------------------------------------------------------- storefs-fdpass: the sidecar pair
def start_mounter(place: Place, worker, sock: str) -> subprocess.Popen:
    _, uid, gid = worker
    log = open(os.path.join(place.top, "mounter.log"), "ab")
    with log:
        proc = subprocess.Popen([FDPASS, "mount", "--socket", sock, "--uid", str(uid), "--gid", str(gid),
                                 "--allow-other", place.mnt], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log, start_new_session=True)
    if not wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, 30):
        pytest.fail("storefs-fdpass mount did not listen within 30 s")
    assert proc.poll() is None, open(os.path.join(place.top, "mounter.log")).read()
    return proc


def test_fdpass_mounts_privileged_and_hands_the_connection_to_unprivileged_storefs(
        storefs_bin, emulator, corpus, worker, place):
    """The sidecar example's two containers as two processes: root mounts and sends the
    descriptor over a Unix socket; the worker's storefs serves it. When storefs dies the next
    one gets a fresh mount; SIGTERM to the mounter unmounts, and storefs exits 0. The mount
    point is itself a mount, as a Kubernetes volume is, and stays one."""
    _, uid, gid = worker
    sock = os.path.join(place.top, "fd.sock")
    mounter = first = second = None
    receive = [FDPASS, "receive", "--socket", sock, "--wait", "30", "--"]
    subprocess.run(["mount", "--bind", place.mnt, place.mnt], check=True, capture_output=True, timeout=30)
    volume = mount_at(place.mnt)
    try:
        mounter = start_mounter(place, worker, sock)
        st = os.stat(sock)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, gid, 0o600)
        first = as_worker(worker, receive + storefs_argv(storefs_bin, emulator, place, "/dev/fd/3"), place)
        wait_served(place.mnt, first, place)
        assert read_whole(os.path.join(place.mnt, corpus.BIG)) == corpus.data[corpus.BIG]
        dev = [l.split(" ")[2] for l in open("/proc/self/mountinfo") if l.split(" ")[4] == place.mnt][-1]
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb") as f:
            assert f.read().strip() == "1024"
        # The first storefs dies: its connection dies with it (the mounter kept no copy).
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        with pytest.raises(OSError):
            os.listdir(place.mnt)
        second = as_worker(worker, receive + storefs_argv(storefs_bin, emulator, place, "/dev/fd/3"), place)
        wait_served(place.mnt, second, place)
        check_corpus(place.mnt, corpus)
        os.kill(mounter.pid, signal.SIGTERM)
        assert mounter.wait(timeout=30) == 0, open(os.path.join(place.top, "mounter.log")).read()
        assert mount_at(place.mnt) == volume, "the mounter unmounted more than its own mounts"
        try:
            rc = second.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"storefs still running after the mounter unmounted:\n{place.stderr()}")
        assert rc == 0, place.stderr()
        assert not os.path.exists(sock)
    finally:
        for p in (second, first, mounter):
            stop(p)
        unmount_all(place.mnt)


def test_fdpass_receive_says_in_one_line_when_no_mounter_answers(worker, place):
    r = subprocess.run([FDPASS, "receive", "--socket", os.path.join(place.top, "none.sock"), "--wait", "0.5",
                        "--", "true"], capture_output=True, text=True, timeout=30)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "is the mounter (storefs-fdpass mount) running" in lines[0], lines[0]
