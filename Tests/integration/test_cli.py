"""Command line, daemon mode, signals and unmounting, mount(8)."""

import os
import signal
import subprocess
import time

import pytest

from gcs_emulator import free_port
from storefs_testlib import (BUCKET, EXIT_TIMEOUT_S, is_mounted, mount_at,
                             pid_alive, pids_with_arg, run_storefs, storefs_on_path, wait_pid_gone,
                             wait_unmounted)

HELLO = "files/hello.txt"


def _read(m, rel):
    with open(m.p(rel), "rb") as f:
        return f.read()


# ---------------------------------------------------------------- failures before mounting
def _bad_cases(emulator_endpoint, proxy_endpoint):
    dead = f"http://127.0.0.1:{free_port()}"
    return {
        "unknown_option": dict(source=BUCKET, endpoint=emulator_endpoint, options=["bogus=1"]),
        "malformed_value": dict(source=BUCKET, endpoint=emulator_endpoint,
                                options=["stat_ttl=abc"]),
        "unreachable_endpoint": dict(source=BUCKET, endpoint=dead, options=[]),
        "missing_bucket": dict(source="no-such-bucket", endpoint=emulator_endpoint, options=[]),
        "forbidden_prefix": dict(source=f"gs://{BUCKET}/private", endpoint=proxy_endpoint,
                                 options=[]),
    }


@pytest.mark.parametrize("foreground", [True, False], ids=["fg", "daemon"])
@pytest.mark.parametrize("case", ["unknown_option", "malformed_value", "unreachable_endpoint",
                                  "missing_bucket", "forbidden_prefix"])
def test_error_before_mount_is_one_line_and_no_mount(mount, proxy, emulator, case, foreground):
    spec = _bad_cases(emulator.endpoint, proxy.endpoint)[case]
    mnt = mount.new_dir("mnt")
    argv, cache = mount.argv(spec["source"], mnt, endpoint=spec["endpoint"],
                             options=spec["options"], foreground=foreground)
    mount.adopt(mnt, cache)   # teardown cleans up if storefs mounts anyway
    r = run_storefs(argv, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode != 0, f"exit 0 for {case}; stderr={r.stderr!r}"
    assert len(lines) == 1 and lines[0].startswith("storefs: "), \
        f"stderr must be exactly one 'storefs: ' line, got {r.stderr!r}"
    assert not is_mounted(mnt)
    time.sleep(0.2)
    assert [p for p in pids_with_arg(mnt) if pid_alive(p)] == [], "a storefs process lingers"
    assert not is_mounted(mnt)


@pytest.mark.parametrize("noise", [
    "rw,ro,dev,suid,_netdev,nofail,noauto,user,defaults,x-systemd.automount",
    "auto,nouser,nodev,nosuid,exec,noexec,x-systemd.requires=network-online.target",
], ids=["noise", "negations"])
def test_mount8_noise_options_are_accepted(mount, corpus, noise):
    m = mount(options=noise.split(","))
    assert _read(m, HELLO) == corpus.data[HELLO]
    with pytest.raises(OSError):
        os.close(os.open(m.p("files/x.txt"), os.O_WRONLY | os.O_CREAT))


# ---------------------------------------------------------------- daemon mode
def test_daemon_mode_mounts_then_goes_away_on_umount(mount, corpus):
    m = mount(foreground=False)   # returns only after storefs exited 0 and the mount exists
    assert m.proc.returncode == 0
    assert _read(m, HELLO) == corpus.data[HELLO]
    assert _read(m, corpus.BIG)[-100:] == corpus.data[corpus.BIG][-100:]
    assert m.pid is not None, "no daemon process found with the mount point in its argv"
    assert m.pid != m.proc.pid, "the daemon should be a forked child, not the launcher"
    r = subprocess.run(["umount", m.path], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert wait_pid_gone(m.pid, EXIT_TIMEOUT_S), "daemon still running after umount"
    assert not is_mounted(m.path)


# ---------------------------------------------------------------- foreground exits
def test_fusermount_u_exits_zero(mount, corpus):
    m = mount()
    assert _read(m, HELLO) == corpus.data[HELLO]
    r = subprocess.run(["fusermount3", "-u", m.path], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert m.wait_exit() == 0, m.stderr()
    assert not is_mounted(m.path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_signal_exits_zero_and_unmounts(mount, corpus, sig):
    m = mount()
    assert _read(m, HELLO) == corpus.data[HELLO]
    os.kill(m.pid, sig)
    assert m.wait_exit() == 0, m.stderr()
    assert wait_unmounted(m.path)
    assert os.listdir(m.path) == []   # a plain directory again, not a dead mount


def test_sigint_works_when_inherited_ignored(mount, corpus):
    """`storefs -f ... &` from a script inherits SIGINT=SIG_IGN; Ctrl-C/kill -INT must still work."""
    m = mount(preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert _read(m, HELLO) == corpus.data[HELLO]
    os.kill(m.pid, signal.SIGINT)
    assert m.wait_exit() == 0, m.stderr()
    assert wait_unmounted(m.path)


def test_sigterm_during_read_exits_zero(mount, proxy, corpus):
    proxy.media_delay = 1.5   # keep the first media GET in flight
    m = mount(endpoint=proxy.endpoint)
    cat = subprocess.Popen(["cat", m.p(corpus.BIG)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while proxy.started["media"] == 0 and time.monotonic() < deadline:
            assert cat.poll() is None, f"cat ended before any media request: {cat.stderr.read()!r}"
            time.sleep(0.01)
        assert proxy.started["media"] > 0, "no media request reached the proxy"
        os.kill(m.pid, signal.SIGTERM)
        assert m.wait_exit() == 0, m.stderr()
        assert wait_unmounted(m.path)
        cat.wait(timeout=EXIT_TIMEOUT_S)   # the reader is released, one way or another
    finally:
        if cat.poll() is None:
            cat.kill()
            cat.wait(timeout=5)


def test_relative_mountpoint_unmounts_on_sigterm(mount, corpus):
    parent = mount.new_dir("rel")
    os.mkdir(os.path.join(parent, "mnt"))
    m = mount(mountpoint="mnt", cwd=parent)
    assert m.path == os.path.join(parent, "mnt")
    assert _read(m, HELLO) == corpus.data[HELLO]
    os.kill(m.pid, signal.SIGTERM)
    assert m.wait_exit() == 0, m.stderr()
    assert wait_unmounted(m.path)
    assert os.listdir(m.path) == []


# ---------------------------------------------------------------- mount(8)
def test_mount_t_fuse_storefs(mount, emulator, corpus, storefs_bin):
    with storefs_on_path(storefs_bin):
        mnt, cache = mount.new_dir("mnt"), mount.new_dir("cache")
        m = mount.adopt(mnt, cache)
        r = subprocess.run(["mount", "-t", "fuse.storefs", BUCKET, mnt, "-o",
                            f"endpoint={emulator.endpoint},anonymous,ca_file={mount.ca_file},"
                            f"cache_dir={cache}"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        entry = mount_at(mnt)
        assert entry is not None and entry[1] == "fuse.storefs", entry
        assert _read(m, HELLO) == corpus.data[HELLO]
        daemons = [p for p in pids_with_arg(mnt) if pid_alive(p)]
        assert daemons, "no storefs process serves the mount"
        r = subprocess.run(["umount", mnt], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        for pid in daemons:
            assert wait_pid_gone(pid, EXIT_TIMEOUT_S), f"storefs pid {pid} still running"
        assert not is_mounted(mnt)
