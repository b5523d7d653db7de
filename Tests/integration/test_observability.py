"""Seeing a running mount (docs/operations.md): log lines (text and JSON, log_file=, SIGHUP
reopen, one line per FUSE operation and HTTP request at debug, repeats counted, SIGUSR1
summary), the `user.storefs.stats` document, Prometheus `/metrics`, `user.storefs.cached`,
and statfs. Objects live in `ops-bucket`; every test reads through a real mount.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import stat
import threading
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from storefs_testlib import errno_of, metrics_over_unix, read_whole, run_storefs

OPS = "ops-bucket"
MiB = 1 << 20
FILES = {
    "logs/a.bin": os.urandom(3 * MiB + 17),
    "logs/b.txt": b"hello operations\n" * 1000,
    "stats/cold.bin": os.urandom(2 * MiB + 5),
    "stats/partial.bin": os.urandom(24 * MiB),
    "metrics/m.bin": os.urandom(1 * MiB + 3),
    "df/d.bin": os.urandom(5 * MiB),
}
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
SECRETS = ("Bearer", "access_token", "Authorization", "X-Goog-Signature")


@pytest.fixture(scope="module")
def obucket(emulator):
    emulator.create_bucket(OPS, exist_ok=True)
    for name, data in FILES.items():
        emulator.upload(OPS, name, data)
    return emulator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stats(path: str) -> dict:
    return json.loads(os.getxattr(path, "user.storefs.stats"))


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def json_lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------- logs

def test_json_log_lines_parse_and_carry_the_fields(mount, obucket):
    log = os.path.join(mount.new_dir("log"), "storefs.log")
    m = mount(OPS, options=[f"log_file={log}", "log_format=json", "log_level=debug"])
    assert read_whole(m.p("logs/b.txt")) == FILES["logs/b.txt"]
    assert errno_of(os.stat, m.p("logs/missing.txt")) == errno.ENOENT
    # A line is written just after its reply, by the thread that replied: wait for the
    # lookup's, and for the reads' (a worker that replied to a read may log after a later
    # lookup's line went out).
    def read_bytes_logged() -> int:
        return sum(l.get("bytes", 0) for l in json_lines(log)
                   if l.get("msg") == "fuse" and l.get("op") == "read" and l.get("result") == "OK")
    assert wait_for(lambda: [l for l in json_lines(log) if l.get("msg") == "fuse" and l.get("name") == "missing.txt"])
    assert wait_for(lambda: read_bytes_logged() >= len(FILES["logs/b.txt"])), read_bytes_logged()
    lines = [l for l in json_lines(log) if l.get("msg") == "http" and l.get("kind") == "media"]
    assert lines, open(log).read()
    every = json_lines(log)
    for line in every:
        assert TS.match(line["ts"]), line
        assert line["level"] in ("error", "warn", "info", "debug", "trace"), line
        assert isinstance(line["msg"], str)
    http = lines[0]
    assert http["method"] == "GET" and http["status"] in (200, 206), http
    assert isinstance(http["bytes"], int) and http["bytes"] > 0 and isinstance(http["dur_ms"], (int, float))
    assert http["attempt"] == 1 and "?" not in http["target"], http
    ops = [l for l in every if l["msg"] == "fuse"]
    lookups = [l for l in ops if l["op"] == "lookup" and l.get("name") == "missing.txt"]
    assert lookups and lookups[0]["result"] == "ENOENT", ops[-20:]
    reads = [l for l in ops if l["op"] == "read" and l["result"] == "OK"]
    assert sum(l["bytes"] for l in reads) >= len(FILES["logs/b.txt"]), reads
    assert all(isinstance(l["dur_ms"], (int, float)) and "ino" in l for l in ops)
    text = open(log).read()
    assert not any(s in text for s in SECRETS), "a credential reached the log"
    assert m.stderr().strip() == "", "with log_file= nothing goes to stderr: " + m.stderr()


def test_text_log_lines_are_logfmt_with_time_and_level(mount, obucket):
    log = os.path.join(mount.new_dir("log"), "storefs.log")
    m = mount(OPS, options=[f"log_file={log}", "log_level=debug"])
    assert read_whole(m.p("logs/b.txt")) == FILES["logs/b.txt"]
    text = wait_for(lambda: (t := open(log).read()) and "msg=http" in t and t)
    for line in text.splitlines():
        assert re.match(r"^ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=(error|warn|info|debug|trace) msg=", line), line
    assert re.search(r"msg=fuse op=lookup ino=\d+ name=b\.txt result=OK dur_ms=[0-9.]+", text), text[-2000:]
    assert re.search(r"msg=http method=GET kind=media target=\S+ status=20[06] bytes=\d+ dur_ms=[0-9.]+ attempt=1", text)


def test_repeated_failures_become_one_line_with_a_count(mount, obucket, proxy):
    log = os.path.join(mount.new_dir("log"), "storefs.log")
    m = mount(OPS, endpoint=proxy.endpoint, options=[f"log_file={log}", "negative_ttl=0"])
    for _ in range(25):
        assert errno_of(os.stat, m.p("private/secret.bin")) == errno.EACCES
    # The first component already fails (its listing is forbidden): that is the failure logged.
    failures = lambda: [l for l in open(log).read().splitlines() if "lookup failed" in l and "path=private " in l]
    assert len(failures()) == 1, open(log).read()
    # When the window closes the count is written, once.
    counted = wait_for(lambda: [l for l in failures() if "repeated=" in l], timeout=15)
    assert len(counted) == 1 and int(re.search(r"repeated=(\d+)", counted[0]).group(1)) == 24, failures()
    assert len(failures()) == 2


def test_a_failed_read_is_logged_once(mount, obucket, proxy):
    log = os.path.join(mount.new_dir("log"), "storefs.log")
    m = mount(OPS, endpoint=proxy.endpoint, options=[f"log_file={log}", "request_timeout=2"])
    fd = os.open(m.p("logs/a.bin"), os.O_RDONLY)
    try:
        proxy.cut()
        with pytest.raises(OSError) as e:
            os.pread(fd, 4096, 0)
        assert e.value.errno == errno.EIO
    finally:
        os.close(fd)
    time.sleep(0.5)
    lines = [l for l in open(log).read().splitlines() if "level=warn" in l or "level=error" in l]
    reads = [l for l in lines if "read failed" in l]
    assert len(reads) == 1, lines


def test_sighup_reopens_the_log_file_and_keeps_the_mount(mount, obucket):
    d = mount.new_dir("log")
    log = os.path.join(d, "storefs.log")
    m = mount(OPS, options=[f"log_file={log}"])
    assert wait_for(lambda: "mounted" in open(log).read())
    os.rename(log, log + ".1")
    os.kill(m.pid, signal.SIGHUP)
    assert wait_for(lambda: os.path.exists(log) and "log file reopened" in open(log).read()), os.listdir(d)
    assert os.path.ismount(m.path) and m.proc.poll() is None
    os.kill(m.pid, signal.SIGUSR1)
    line = wait_for(lambda: [l for l in open(log).read().splitlines() if "msg=stats" in l])
    assert line and "uptime_s=" in line[0] and "cache_used_bytes=" in line[0], open(log).read()
    assert "log file reopened" not in open(log + ".1").read()
    assert read_whole(m.p("logs/b.txt")) == FILES["logs/b.txt"]
    assert m.proc.poll() is None


def test_log_file_that_is_a_link_is_refused(mount, obucket, storefs_bin):
    d = mount.new_dir("log")
    target = os.path.join(d, "victim")
    open(target, "w").close()
    link = os.path.join(d, "storefs.log")
    os.symlink(target, link)
    mnt = mount.new_dir("mnt")
    argv, _ = mount.argv(OPS, mnt, endpoint=None, options=[f"log_file={link}"])
    r = run_storefs(argv)
    assert r.returncode != 0 and "symbolic link" in r.stderr, r.stderr
    assert not os.path.ismount(mnt) and os.path.getsize(target) == 0


# ---------------------------------------------------------------- stats xattr

def test_stats_count_a_cold_read_then_cache_hits(mount, obucket):
    m = mount(OPS)
    name, data = "stats/cold.bin", FILES["stats/cold.bin"]
    before = stats(m.path)
    assert read_whole(m.p(name)) == data
    after = stats(m.path)
    got = after["storage"]["downloaded_bytes"].get("media", 0) - before["storage"]["downloaded_bytes"].get("media", 0)
    assert got >= len(data), (before, after)
    assert after["fuse"]["read_bytes"] - before["fuse"]["read_bytes"] == len(data)
    assert after["cache"]["misses"] > before["cache"]["misses"]
    assert after["cache"]["capacity_bytes"] > 0 and after["memory"]["limit_bytes"] == 256 * MiB
    assert after["fuse"]["ops"]["read"] > before["fuse"]["ops"].get("read", 0)
    assert after["storage"]["requests"]["media"]
    # Read again (page cache dropped): answered from the block cache, nothing downloaded.
    # (Once the cache copies of the read-ahead parts have landed: until then a read is served
    # from the parts' memory, which is not a cache hit.)
    # (The download that completed the file is answered before its cache copy is written.)
    assert cached_once_written(m.p(name), len(data)) == len(data)
    after = stats(m.path)
    assert after["cache"]["used_bytes"] >= len(data)
    assert read_whole(m.p(name)) == data
    again = stats(m.path)
    assert again["cache"]["hits"] > after["cache"]["hits"]
    assert again["cache"]["hit_bytes"] - after["cache"]["hit_bytes"] == len(data)
    assert again["storage"]["downloaded_bytes"]["media"] == after["storage"]["downloaded_bytes"]["media"]
    assert again["uptime_s"] >= after["uptime_s"]
    assert "user.storefs.stats" in os.listxattr(m.path)


def test_stats_count_errors_by_errno(mount, obucket):
    m = mount(OPS)
    before = stats(m.path)["fuse"]["errors"].get("EROFS", 0)
    with pytest.raises(OSError):
        open(m.p("logs/new.txt"), "w")
    assert errno_of(os.mkdir, m.p("logs/newdir")) == errno.EROFS
    # The kernel refuses some writes of a read-only mount itself; what reaches the daemon counts.
    assert stats(m.path)["fuse"]["errors"].get("EROFS", 0) >= before
    assert errno_of(os.stat, m.p("logs/nope")) == errno.ENOENT
    assert stats(m.path)["fuse"]["errors"]["ENOENT"] >= 1


def test_stats_are_the_mounting_users_only(mount, obucket):
    m = mount(OPS, options=["allow_other"])
    os.chmod(mount.tmp, 0o711)   # nobody may pass through to the mount, or EACCES proves nothing

    def as_nobody():
        os.setgid(65534)
        os.setuid(65534)

    probe = ("import os,errno\n"
             "os.stat(%r)\n"
             "try:\n os.getxattr(%r,'user.storefs.stats'); print('read')\n"
             "except OSError as e: print(errno.errorcode[e.errno])\n" % (m.path, m.path))
    r = subprocess.run(["python3", "-c", probe], capture_output=True, text=True, preexec_fn=as_nobody, timeout=30)
    assert r.stdout.strip() == "EACCES", (r.stdout, r.stderr)
    assert "cache" in stats(m.path)


def test_cached_attribute_is_the_mounting_users_only(mount, obucket):
    """What was just read tells what another user reads: like stats, `cached` is the mounting
    user's and root's (issue 43, item 5)."""
    m = mount(OPS, options=["allow_other"])
    os.chmod(mount.tmp, 0o711)   # nobody may pass through to the mount, or EACCES proves nothing
    path = m.p("stats/partial.bin")

    def as_nobody():
        os.setgid(65534)
        os.setuid(65534)

    probe = ("import os,errno\n"
             "assert open(%r,'rb').read(1)\n"
             "try:\n os.getxattr(%r,'user.storefs.cached'); print('read')\n"
             "except OSError as e: print(errno.errorcode[e.errno])\n"
             "print('listed' if 'user.storefs.cached' in os.listxattr(%r) else 'hidden')\n" % (path, path, path))
    r = subprocess.run(["python3", "-c", probe], capture_output=True, text=True, preexec_fn=as_nobody, timeout=30)
    assert r.stdout.split() == ["EACCES", "hidden"], (r.stdout, r.stderr)
    assert int(os.getxattr(path, "user.storefs.cached")) > 0   # nobody's read, told to root
    assert "user.storefs.cached" in os.listxattr(path)


# ---------------------------------------------------------------- metrics

def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out


def test_metrics_endpoint_counts_a_known_read(mount, obucket):
    port = free_port()
    m = mount(OPS, options=[f"metrics=127.0.0.1:{port}"])
    name, data = "metrics/m.bin", FILES["metrics/m.bin"]
    before = scrape(port)
    assert read_whole(m.p(name)) == data
    after = scrape(port)
    delta = lambda k: after.get(k, 0) - before.get(k, 0)
    assert delta("storefs_fuse_read_bytes_total") == len(data)
    assert delta('storefs_http_received_bytes_total{kind="media"}') >= len(data)
    assert delta("storefs_cache_misses_total") >= 1
    assert delta('storefs_fuse_read_duration_seconds_count') == delta('storefs_fuse_operations_total{op="read"}') > 0
    assert after['storefs_fuse_read_duration_seconds_bucket{le="+Inf"}'] == after["storefs_fuse_read_duration_seconds_count"]
    assert after['storefs_http_request_duration_seconds_count{kind="media"}'] >= 1
    assert after["storefs_cache_capacity_bytes"] > 0 and after["storefs_memory_limit_bytes"] == 256 * MiB
    assert read_whole(m.p(name)) == data
    again = scrape(port)
    assert again["storefs_cache_hit_bytes_total"] - after["storefs_cache_hit_bytes_total"] == len(data)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
    assert e.value.code == 404
    # A client that connects and says nothing does not stop the next scrape for long.
    idle = socket.create_connection(("127.0.0.1", port))
    try:
        t0 = time.monotonic()
        scrape(port)
        assert time.monotonic() - t0 < 8
    finally:
        idle.close()


def test_metrics_stay_on_loopback_unless_asked(mount, obucket):
    mnt = mount.new_dir("mnt")
    argv, _ = mount.argv(OPS, mnt, endpoint=None, options=[f"metrics=0.0.0.0:{free_port()}"])
    r = run_storefs(argv)
    assert r.returncode != 0 and "metrics_bind_any" in r.stderr, r.stderr
    assert len([l for l in r.stderr.splitlines() if l.strip()]) == 1
    assert not os.path.ismount(mnt)


def test_a_taken_metrics_port_warns_and_is_served_once_free(mount, obucket):
    """Whoever holds the port (a user who grabbed it first, or while a crashed mount restarts)
    does not keep the mount down: a warning, then the port once it is free (issue 43, item 4)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        m = mount(OPS, options=[f"metrics=127.0.0.1:{port}"])
        assert "cannot listen there" in m.stderr() and "retrying" in m.stderr(), m.stderr()
        assert read_whole(m.p("metrics/m.bin")) == FILES["metrics/m.bin"]
    finally:
        taken.close()
    deadline = time.monotonic() + 25
    while True:
        try:
            assert scrape(port)["storefs_fuse_read_bytes_total"] >= len(FILES["metrics/m.bin"])
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline, "the freed port was never listened on"
            time.sleep(0.5)


def test_trickling_clients_do_not_stall_scrapes(mount, obucket):
    """A client sending a byte every 4 s made three scrapes in a row time out: each scrape has one
    deadline, and several are served at once."""
    port = free_port()
    mount(OPS, options=[f"metrics=127.0.0.1:{port}"])
    scrape(port)
    stop = threading.Event()

    def trickle():
        with socket.create_connection(("127.0.0.1", port)) as c:
            for b in b"GET /metrics HTTP/1.1\r\n":
                if stop.wait(4):
                    return
                try:
                    c.send(bytes([b]))
                except OSError:
                    return   # dropped at its deadline

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        for _ in range(3):
            t0 = time.monotonic()
            scrape(port)
            assert time.monotonic() - t0 < 2, "a scrape waited behind a trickling client"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)


def test_metrics_on_a_unix_socket_are_the_owners_and_groups(mount, obucket, tmp_path):
    sock = str(tmp_path / "metrics.sock")
    m = mount(OPS, options=[f"metrics=unix:{sock}"])
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert read_whole(m.p("metrics/m.bin")) == FILES["metrics/m.bin"]
    head, _, body = metrics_over_unix(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"storefs_fuse_read_bytes_total" in body
    plain = tmp_path / "not-a-socket"
    plain.write_bytes(b"keep me")
    argv, _ = mount.argv(OPS, mount.new_dir("mnt"), endpoint=None, options=[f"metrics=unix:{plain}"])
    r = run_storefs(argv)
    assert r.returncode != 0 and "not a socket" in r.stderr, r.stderr
    assert plain.read_bytes() == b"keep me"


# ---------------------------------------------------------------- per file, statfs

def cached_once_written(path: str, at_least: int, timeout: float = 5.0) -> int:
    """user.storefs.cached once it reaches `at_least`, or its last value after `timeout`: a
    part's cache copy is written after the read it answered has been replied to."""
    deadline = time.monotonic() + timeout
    while True:
        value = int(os.getxattr(path, "user.storefs.cached"))
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def test_cached_attribute_follows_what_was_read(mount, obucket):
    m = mount(OPS)
    name, data = "stats/partial.bin", FILES["stats/partial.bin"]
    path = m.p(name)
    assert int(os.getxattr(path, "user.storefs.cached")) == 0
    with open(path, "rb") as f:
        assert f.read(100_000) == data[:100_000]
    partial = cached_once_written(path, 100_000)
    assert 100_000 <= partial < len(data), partial
    assert read_whole(path) == data
    assert cached_once_written(path, len(data)) == len(data)
    assert "user.storefs.cached" in os.listxattr(path)
    assert errno_of(os.getxattr, m.p("stats"), "user.storefs.cached") == errno.ENODATA


def test_statfs_reports_the_cache_and_df_shows_the_mount(mount, obucket):
    m = mount(OPS, options=["cache_size=64M"])
    st = os.statvfs(m.path)
    assert st.f_frsize == MiB and st.f_blocks == 64, st
    free_before = st.f_bfree
    assert read_whole(m.p("df/d.bin")) == FILES["df/d.bin"]
    # The last part's cache copy may still be being written after the read's reply.
    assert cached_once_written(m.p("df/d.bin"), len(FILES["df/d.bin"])) == len(FILES["df/d.bin"])
    st = os.statvfs(m.path)
    assert st.f_bfree <= free_before - 5, (free_before, st)
    assert st.f_bavail == st.f_bfree and st.f_files > 0
    df = subprocess.run(["df", "-P", m.path], capture_output=True, text=True, timeout=30)
    assert df.returncode == 0 and m.path in df.stdout, df
    assert "64M" in subprocess.run(["df", "-h", m.path], capture_output=True, text=True).stdout
