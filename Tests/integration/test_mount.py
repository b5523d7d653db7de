"""Fitting into Linux's mount tools (README, "mount -t fuse.storefs and fstab"): kernel mount
flags, the source the kernel shows, and the mount point checks.

Objects for the exec tests live in `mountfit-bucket`; the rest reads the corpus bucket.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from storefs_testlib import (BUCKET, EXIT_TIMEOUT_S, is_mounted, mount_at, pid_alive, pids_with_arg,
                             storefs_on_path, wait_pid_gone)

MB = "mountfit-bucket"
SCRIPT = "bin/run.sh"


@pytest.fixture(scope="module")
def fitbucket(emulator):
    emulator.create_bucket(MB, exist_ok=True)
    emulator.upload(MB, SCRIPT, b"#!/bin/sh\necho ran\n")
    return emulator


def _options(path: str) -> set[str]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path:
                return set(fields[5].split(","))
    raise AssertionError(f"{path} is not mounted")


def test_default_flags_are_exec_nosuid_nodev(mount, fitbucket):
    m = mount(MB, options=["file_mode=0755"])
    flags = _options(m.path)
    assert {"nosuid", "nodev"} <= flags and "noexec" not in flags, flags
    out = subprocess.run([m.p(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert out.stdout == "ran\n", out


def test_noexec_is_honoured(mount, fitbucket):
    m = mount(MB, options=["file_mode=0755", "noexec"])
    assert "noexec" in _options(m.path)
    with pytest.raises(PermissionError):
        subprocess.run([m.p(SCRIPT)], capture_output=True, timeout=30)


def test_suid_and_dev_are_honoured_for_root_and_the_last_flag_wins(mount, fitbucket):
    m = mount(MB, options=["nosuid", "suid", "dev"])
    flags = _options(m.path)
    assert "nosuid" not in flags and "nodev" not in flags, flags
    st = os.stat(m.p(SCRIPT))
    assert st.st_mode & 0o7000 == 0, "setuid/setgid bits must never appear"


@pytest.mark.parametrize("source", ["test-bucket", "gs://test-bucket", "gs://test-bucket/files/"])
def test_the_kernel_source_is_source_as_written(mount, corpus, source):
    m = mount(source)
    assert mount_at(m.path)[2] == source


def test_mount_a_twice_is_idempotent(mount, emulator, corpus, storefs_bin):
    forms = ["test-bucket", "gs://test-bucket", "gs://test-bucket/files"]
    points = [mount.new_dir("mnt") for _ in forms]
    fstab = os.path.join(mount.new_dir("etc"), "fstab")
    with open(fstab, "w") as f:
        for source, mnt in zip(forms, points):
            f.write(f"{source} {mnt} fuse.storefs endpoint={emulator.endpoint},anonymous,"
                    f"ca_file={mount.ca_file},cache_dir={mount.new_dir('cache')},_netdev,nofail 0 0\n")
    for source, mnt in zip(forms, points):
        mount.adopt(mnt, "")
    with storefs_on_path(storefs_bin):
        for attempt in (1, 2):
            r = subprocess.run(["mount", "-a", "-T", fstab, "-t", "fuse.storefs"], capture_output=True,
                               text=True, timeout=120)
            assert r.returncode == 0, f"mount -a (attempt {attempt}) exited {r.returncode}: {r.stderr}"
            for source, mnt in zip(forms, points):
                assert mount_at(mnt)[2] == source
            with open("/proc/self/mountinfo") as f:
                count = sum(1 for line in f if line.split()[4] in points)
            assert count == len(forms), f"after mount -a #{attempt}: {count} mounts for {len(forms)} entries"
    with open(os.path.join(points[2], "hello.txt"), "rb") as f:
        assert f.read() == corpus.data["files/hello.txt"]


def _try_mount(mount, mnt, *options) -> subprocess.CompletedProcess:
    argv, _ = mount.argv(BUCKET, mnt, endpoint=mount.default_endpoint, options=list(options))
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def _one_line(r: subprocess.CompletedProcess) -> str:
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    return lines[0]


def test_a_non_empty_directory_is_refused_unless_nonempty(mount, corpus):
    mnt = mount.new_dir("mnt")
    with open(os.path.join(mnt, "precious.txt"), "w") as f:
        f.write("mine\n")
    line = _one_line(_try_mount(mount, mnt))
    assert "not empty" in line and "nonempty" in line, line
    assert not is_mounted(mnt)
    m = mount(BUCKET, mountpoint=mnt, options=["nonempty"])
    assert "files" in os.listdir(m.path)
    assert mount.unmount(m) == []
    assert os.listdir(mnt) == ["precious.txt"]


def test_a_live_mount_is_never_mounted_over(mount, corpus):
    m = mount()
    line = _one_line(_try_mount(mount, m.path, "nonempty"))
    assert "already a mount point" in line, line
    with open(m.p("files/hello.txt"), "rb") as f:
        assert f.read() == corpus.data["files/hello.txt"]


def test_a_dead_mount_gets_the_hint(mount, corpus):
    m = mount()
    os.kill(m.pid, signal.SIGKILL)
    assert wait_pid_gone(m.pid, EXIT_TIMEOUT_S)
    try:
        line = _one_line(_try_mount(mount, m.path))
        assert "dead FUSE mount" in line and f"fusermount3 -u {m.path}" in line, line
    finally:
        subprocess.run(["fusermount3", "-u", m.path], capture_output=True, timeout=30)
        if is_mounted(m.path):
            subprocess.run(["umount", "-l", m.path], capture_output=True, timeout=30)


def test_an_endpoint_that_is_not_a_storage_api_says_so(mount, tmp_path):
    """A plain web server at endpoint= answers 404 pages, not storage API errors: the message
    says so, instead of "bucket does not exist"."""
    import http.server
    import threading
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        mnt = mount.new_dir("mnt")
        argv, _ = mount.argv(BUCKET, mnt, endpoint=f"http://127.0.0.1:{server.server_address[1]}")
        line = _one_line(subprocess.run(argv, capture_output=True, text=True, timeout=60))
        assert "not a storage API" in line and "endpoint=" in line, line
        assert not is_mounted(mnt)
    finally:
        server.shutdown()
        server.server_close()
