"""Hostile local users and hostile input, over real mounts (docs/security.md).

Option smuggling, refused modes and URLs, proxy variables on loopback, names compared as
bytes, log injection. The cache directory rules are in test_cache_security.py, server faults
in test_faults.py.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from storefs_testlib import BUCKET, mount_at, run_storefs

# A bucket of its own: the corpus bucket is listed exactly by other tests.
HB = "hardening-bucket"
NFC = "bytes/caf\u00e9.txt"
NFD = "bytes/cafe\u0301.txt"
K = "bytes/Key.sh"
KELVIN = "bytes/\u212aey.sh"
INJECT = "inject/evil\nstorefs[error] FORGED \x1b[31mred"


def _mount_options(path: str) -> list[str]:
    """The options field of the mount at `path` in /proc/self/mountinfo (VFS flags)."""
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            if fields[4] == real:
                opts = fields[5]
    return opts.split(",")


def test_an_escaped_comma_cannot_smuggle_suid_in(mount):
    """-o 'fsname=gs://x\\,suid' used to reach libfuse as fsname=gs://x + suid: nosuid gone."""
    m = mount(BUCKET, options=["fsname=gs://x\\,suid\\,dev", "allow_other"])
    opts = _mount_options(m.path)
    assert "nosuid" in opts and "nodev" in opts, opts
    entry = mount_at(m.path)
    assert entry is not None and entry[2] == "gs://x,suid,dev", entry


def test_setuid_modes_are_refused(mount):
    argv, _ = mount.argv(BUCKET, mount.new_dir("mnt"), endpoint=None, options=["file_mode=4755"])
    r = run_storefs(argv)
    assert r.returncode != 0
    assert "file_mode=4755 sets setuid, setgid or sticky bits" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


def test_an_endpoint_hiding_its_host_behind_a_user_part_is_refused(mount):
    """http://127.0.0.1:x@evil.example/ is evil.example: it must never pass as loopback."""
    argv, _ = mount.argv(BUCKET, mount.new_dir("mnt"), endpoint="http://127.0.0.1:1@evil.example/",
                         options=[])
    r = run_storefs(argv)
    assert r.returncode != 0 and "carries a user name or password" in r.stderr, r.stderr


class _Trap:
    """A TCP listener that counts connections: where proxy variables point."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            c.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_proxy_variables_never_reroute_tokens_for_loopback(mount, emulator, corpus, tmp_path,
                                                           scheme):
    """Requests to a loopback endpoint go straight there, whatever http(s)_proxy/ALL_PROXY say
    (storefs inherits this test's environment): over https (the emulator's TLS port) and over
    plain http (its plain port: there tokens would travel in clear, the case this guards)."""
    token = tmp_path / "token"
    token.write_text("secret-token-value\n")
    token.chmod(0o600)
    trap = _Trap()
    names = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "ALL_PROXY", "all_proxy")
    saved = {k: os.environ.get(k) for k in names}
    endpoint = emulator.endpoint if scheme == "https" else emulator.http_endpoint
    try:
        for k in names:
            os.environ[k] = f"http://127.0.0.1:{trap.port}"
        m = mount(BUCKET, endpoint=endpoint)
        with open(m.p("files/hello.txt"), "rb") as f:
            assert f.read() == corpus.data["files/hello.txt"]
        assert trap.connections == 0, "a request to the loopback endpoint went to the proxy"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        trap.close()


def test_names_are_bytes_not_unicode(mount, emulator):
    """NFC/NFD spellings and K/KELVIN SIGN are equal Swift Strings but four objects."""
    bodies = {NFC: b"nfc\n", NFD: b"nfd\n", K: b"ascii K\n", KELVIN: b"kelvin sign\n"}
    emulator.create_bucket(HB, exist_ok=True)
    for name, body in bodies.items():
        emulator.upload(HB, name, body)
    m = mount(HB)
    listed = set(os.listdir(m.p("bytes").encode()))
    assert listed == {n.split("/", 1)[1].encode() for n in bodies}, listed
    inodes = set()
    for name, body in bodies.items():
        path = m.p(name).encode()
        with open(path, "rb") as f:
            assert f.read() == body, name
        inodes.add(os.stat(path).st_ino)
    assert len(inodes) == 4


def test_object_names_cannot_forge_log_lines(mount, emulator):
    """A newline and an escape sequence in a name are escaped in the log."""
    emulator.create_bucket(HB, exist_ok=True)
    emulator.upload(HB, INJECT, b"shadowed\n")
    emulator.upload(HB, INJECT + "/inside.txt", b"inside\n")
    m = mount(HB, options=["log_level=debug"])
    os.listdir(m.p("inject"))   # the listing logs the hidden file by name
    err = m.stderr()
    assert "FORGED" in err, "the name was never logged: the test proves nothing"
    assert not any(line.startswith("storefs[error] FORGED") for line in err.splitlines()), err
    assert "\x1b" not in err
    assert "evil\\x0astorefs[error] FORGED \\x1b[31mred" in err
