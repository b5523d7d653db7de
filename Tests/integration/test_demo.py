"""`scripts/demo`, run for real: the download URLs it prints serve the objects (issue 42), and
its state directory cannot be turned against the user who runs it (issue 43, item 1).

Each test gives the demo a state directory of its own (STOREFS_DEMO_DIR under the test's
temporary directory) and STOREFS_BIN, so no build happens; the demo still runs
scripts/install-deps, which is quiet when everything is installed. A throwaway system user
(made with useradd for this module, removed at teardown) plays the other local user. Whatever
a demo leaves behind is stopped by pid and unmounted at teardown, old code's leftovers too.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from storefs_testlib import (is_mounted, mount_entries, pid_alive, pids_with_arg, throwaway_user,
                             wait_pid_gone)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "scripts", "demo")
BUCKET = "demo-bucket"
URL_RE = re.compile(r"https?://[^\s\"'),]+")   # "," ends one in -o endpoint=URL,...
PRECIOUS = b"precious: nothing may write here\n"


# ---------------------------------------------------------------- helpers and fixtures
def run_demo(args: list[str], state: str, storefs_bin: str, user: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    env.update(STOREFS_DEMO_DIR=state, STOREFS_BIN=storefs_bin)
    argv = [DEMO, *args]
    if user is not None:
        argv = ["runuser", "-u", user, "--", "env", f"STOREFS_DEMO_DIR={state}",
                f"STOREFS_BIN={storefs_bin}", *argv]
    return subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def refusal(r: subprocess.CompletedProcess) -> str:
    """The one line a refused demo prints; fails the test if it was not refused."""
    assert r.returncode != 0, f"the demo was not refused:\n{r.stdout}\n{r.stderr}"
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"want one line saying what is wrong, got:\n{r.stderr}"
    assert lines[0].startswith("scripts/demo: refusing state directory "), lines[0]
    assert "STOREFS_DEMO_DIR" in lines[0], f"the line does not say how to fix it: {lines[0]}"
    return lines[0]


def mounts_under(path: str) -> list[tuple[str, str, str]]:
    return [e for e in mount_entries() if e[0] == path or e[0].startswith(path.rstrip("/") + "/")]


def stop_leftovers(top: str) -> list[str]:
    """Unmounts every storefs mount under `top` and stops every process whose arguments name
    a path under it (emulators, daemons): by pid. Returns what it had to clean."""
    cleaned = []
    for mnt, fstype, _ in reversed(mounts_under(top)):
        if fstype.startswith("fuse"):
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True, timeout=30)
            cleaned.append(f"mount {mnt}")
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode("utf-8", "replace").split("\0")
        except OSError:
            continue
        if any(top in a for a in argv) and pid_alive(int(d)):
            try:
                os.kill(int(d), signal.SIGTERM)
            except ProcessLookupError:
                continue
            if not wait_pid_gone(int(d), 10):
                os.kill(int(d), signal.SIGKILL)
            cleaned.append(f"pid {d} {' '.join(argv)[:200]}")
    return cleaned


@pytest.fixture
def top(tmp_path):
    """A root-owned 0755 directory in /tmp that the throwaway user can reach (the pytest
    temporary directory is 0700), cleaned up after the test."""
    d = tempfile.mkdtemp(prefix="storefs-demo-test-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        stop_leftovers(d)
        for mnt, _, _ in reversed(mounts_under(d)):
            subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def other_user():
    """A throwaway system user with no home and no shell: (name, uid, gid)."""
    with throwaway_user("sfdemo", "the demo tests need") as user:
        yield user


def private_dir(path: str) -> str:
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)
    return path


def victim(path: str) -> str:
    """A root-owned 0600 file that nothing may write to."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, PRECIOUS)
    os.close(fd)
    return path


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def assert_nothing_started(state: str) -> None:
    assert not mounts_under(state), f"the refused demo mounted something: {mounts_under(state)}"
    assert not pids_with_arg(os.path.join(state, "endpoint")), "the refused demo started an emulator"


# ---------------------------------------------------------------- issue 42: URLs that work
def test_demo_prints_download_urls_that_serve_the_objects(top, storefs_bin):
    state = os.path.join(top, "state")       # the demo makes it (0700)
    r = run_demo([], state, storefs_bin)
    try:
        assert r.returncode == 0, f"the demo failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
        mnt = os.path.join(state, "mnt")
        assert is_mounted(mnt)
        endpoint = read(os.path.join(state, "endpoint")).decode().strip()
        urls = sorted(set(URL_RE.findall(r.stdout + r.stderr)))
        downloads = [u for u in urls if u != endpoint]
        assert set(urls) - set(downloads) <= {endpoint}
        # At least the two the tour shows: getfattr -d of a plain object, and the object
        # that carries a Firebase download token.
        names = set()
        for url in downloads:
            try:
                with urllib.request.urlopen(url, timeout=10) as resp:
                    status, body = resp.status, resp.read()
            except urllib.error.HTTPError as e:
                status, body = e.code, e.read()
            assert status == 200, f"{url}, printed by the demo, answers HTTP {status}: {body[:200]!r}"
            m = re.search(r"/b/([^/]+)/o/([^?#]+)", urllib.parse.urlsplit(url).path)
            assert m and m.group(1) == BUCKET, url
            name = urllib.parse.unquote(m.group(2))
            assert body == read(os.path.join(mnt, name)), f"{url} does not serve {name}"
            names.add(name)
        assert {"docs/readme.txt", "images/shared.png"} <= names, (names, r.stdout)
        assert read(os.path.join(mnt, "images/shared.png")).startswith(b"\x89PNG")
        st = os.lstat(state)
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700), f"state directory mode {oct(st.st_mode)}"
    finally:
        s = run_demo(["stop"], state, storefs_bin, timeout=120)
    assert s.returncode == 0, s.stderr
    assert not mounts_under(state), "scripts/demo stop left the mount"
    assert not pids_with_arg(os.path.join(state, "endpoint")), "scripts/demo stop left the emulator"


# ---------------------------------------------------------------- issue 43.1: the state dir
def test_state_dir_another_user_made_is_refused(top, storefs_bin, other_user):
    """Root's demo, given a directory the other user made first (the /tmp squat)."""
    name, uid, _ = other_user
    shared = os.path.join(top, "tmp")            # like /tmp: world-writable and sticky
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    state = os.path.join(shared, "theirs")
    subprocess.run(["runuser", "-u", name, "--", "mkdir", "-m", "0755", state], check=True, timeout=30)
    assert os.stat(state).st_uid == uid
    r = run_demo([], state, storefs_bin)
    try:
        assert os.listdir(state) == [], f"the demo wrote into their directory: {os.listdir(state)}"
        line = refusal(r)
        assert f"belongs to uid {uid}" in line, line
        assert_nothing_started(state)
        # stop too: it must not act on what their directory names
        line = refusal(run_demo(["stop"], state, storefs_bin))
        assert f"belongs to uid {uid}" in line, line
    finally:
        stop_leftovers(state)


def test_state_dir_of_root_is_refused_to_another_user(top, storefs_bin, other_user):
    """The other way round: the throwaway user's demo, given a directory root made."""
    name, uid, _ = other_user
    state = os.path.join(top, "roots")
    os.mkdir(state, 0o755)
    r = run_demo([], state, storefs_bin, user=name)
    assert os.listdir(state) == []
    line = refusal(r)
    assert "belongs to uid 0" in line and f"(uid {uid})" in line, line
    assert_nothing_started(state)


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o777])
def test_state_dir_writable_by_group_or_others_is_refused(top, storefs_bin, mode):
    state = os.path.join(top, "open")
    os.mkdir(state)
    os.chmod(state, mode)
    r = run_demo([], state, storefs_bin)
    try:
        assert os.listdir(state) == [], f"the demo wrote into the open directory: {os.listdir(state)}"
        line = refusal(r)
        assert "group or others can write to it" in line and oct(mode)[2:] in line, line
        assert_nothing_started(state)
    finally:
        stop_leftovers(state)


def test_state_dir_that_is_a_symlink_is_refused(top, storefs_bin, other_user):
    """A link the other user planted, pointing at a private root directory."""
    name, uid, gid = other_user
    target = private_dir(os.path.join(top, "root-private"))
    state = os.path.join(top, "link")
    os.symlink(target, state)
    os.lchown(state, uid, gid)
    r = run_demo([], state, storefs_bin)
    try:
        assert os.listdir(target) == [], f"the demo followed the link: {os.listdir(target)}"
        line = refusal(r)
        assert "is a symbolic link" in line, line
        assert_nothing_started(target)
        assert_nothing_started(state)
    finally:
        stop_leftovers(target)
        stop_leftovers(state)


def test_planted_links_in_the_state_dir_write_nothing_outside(top, storefs_bin):
    """emulator.log, emulator.pid and endpoint.tmp planted as links to root's 0600 files:
    the demo replaces the links, and the files they point at keep their bytes."""
    state = private_dir(os.path.join(top, "state"))
    outside = private_dir(os.path.join(top, "outside"))
    planted = {}
    for f in ("emulator.log", "emulator.pid", "endpoint.tmp", "endpoint", "mountpoint"):
        planted[f] = victim(os.path.join(outside, f + ".victim"))
        os.symlink(planted[f], os.path.join(state, f))
    r = run_demo([], state, storefs_bin)
    try:
        for f, path in planted.items():
            assert read(path) == PRECIOUS, f"the demo wrote through the planted {f} link into {path}"
        assert r.returncode == 0, f"the demo failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
        for f in ("emulator.log", "emulator.pid", "endpoint", "mountpoint"):
            st = os.lstat(os.path.join(state, f))
            assert not os.path.islink(os.path.join(state, f)), f
            assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600), (f, oct(st.st_mode))
        assert is_mounted(os.path.join(state, "mnt"))
    finally:
        s = run_demo(["stop"], state, storefs_bin, timeout=120)
        for f, path in planted.items():
            assert read(path) == PRECIOUS, f"scripts/demo stop wrote through {f} into {path}"
        left = stop_leftovers(state)
    assert s.returncode == 0, s.stderr
    assert left == [], f"scripts/demo stop left {left}"


@pytest.mark.parametrize("how", ["file", "symlink"])
def test_planted_mountpoint_of_another_mount_is_not_unmounted(top, storefs_bin, how):
    """`mountpoint` naming a mount the demo did not make (a tmpfs): stop leaves it alone."""
    state = private_dir(os.path.join(top, "state"))
    other = private_dir(os.path.join(top, "other-mount"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "storefs-demo-test", other],
                   check=True, capture_output=True, timeout=30)
    try:
        if how == "file":
            with open(os.path.join(state, "mountpoint"), "w") as f:
                f.write(other + "\n")
        else:
            holder = os.path.join(top, "names-the-mount")
            with open(holder, "w") as f:
                f.write(other + "\n")
            os.symlink(holder, os.path.join(state, "mountpoint"))
        r = run_demo(["stop"], state, storefs_bin, timeout=120)
        assert is_mounted(other), f"scripts/demo stop unmounted {other}: {r.stdout}{r.stderr}"
        assert r.returncode == 0, r.stderr
    finally:
        subprocess.run(["umount", other], capture_output=True, timeout=30)


def test_planted_mountpoint_of_a_storefs_mount_the_demo_did_not_make(top, storefs_bin, mount):
    """A fuse.storefs mount of the same user, but not served by the pid the demo recorded."""
    m = mount()
    state = private_dir(os.path.join(top, "state"))
    with open(os.path.join(state, "mountpoint"), "w") as f:
        f.write(m.path + "\n")
    with open(os.path.join(state, "storefs.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")                   # a live pid of ours, not a storefs
    r = run_demo(["stop"], state, storefs_bin, timeout=120)
    assert is_mounted(m.path), f"scripts/demo stop unmounted {m.path}: {r.stdout}{r.stderr}"
    assert r.returncode == 0, r.stderr
    assert "not served by the storefs the demo started" in r.stderr, r.stderr


def test_planted_emulator_pid_of_another_user_is_not_signalled(top, storefs_bin, other_user):
    """`emulator.pid` naming the other user's process whose arguments look like the
    emulator's: stop (as root) leaves it running."""
    name, _, _ = other_user
    state = private_dir(os.path.join(top, "state"))
    pid = None
    p = subprocess.Popen(["runuser", "-u", name, "--", "python3", "-c",
                          "import time; time.sleep(120)", "Tests/integration/gcs_emulator.py",
                          "gcs_emulator.py"],
                         cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        # the python3 child of runuser is the process that looks like the emulator
        for _ in range(200):
            kids = [q for q in pids_with_arg("Tests/integration/gcs_emulator.py")
                    if q != p.pid and pid_alive(q)]
            if kids:
                pid = kids[0]
                break
            time.sleep(0.05)
        assert pid is not None, "the look-alike process did not start"
        with open(os.path.join(state, "emulator.pid"), "w") as f:
            f.write(f"{pid}\n")
        r = run_demo(["stop"], state, storefs_bin, timeout=120)
        assert pid_alive(pid), f"scripts/demo stop signalled the other user's pid {pid}: {r.stdout}"
        assert r.returncode == 0, r.stderr
    finally:
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        p.kill()
        p.wait(timeout=30)
