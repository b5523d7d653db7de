"""Shared pieces of the storefs integration suite: the corpus, the 403 proxy, mount handling.

conftest.py turns these into fixtures; test modules import the helpers directly
(`from storefs_testlib import ...`). Nothing here is pytest-specific except `pytest.fail`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import datetime as _dt
import errno
import gzip
import hashlib
import http.client
import http.server
import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pytest

import tls_fixture
from gcs_emulator import GCSEmulator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = "test-bucket"
MOUNT_TIMEOUT_S = 30.0       # from spawn to the mount showing in /proc/self/mountinfo
EXIT_TIMEOUT_S = 10.0        # from unmount/signal to the storefs process being gone
WATCHDOG_S = 90.0            # a test holding mounts longer than this gets its storefs killed
DEFAULT_BIN = "/work/main/.build/debug/storefs"


class _Auto:
    """The `ca_file=` default of the mount factories: the session CA when the endpoint is https."""

    def __repr__(self) -> str:
        return "AUTO"


AUTO = _Auto()


def storefs_bin() -> str:
    """The storefs executable under test; fails the test loudly when it is missing."""
    path = os.environ.get("STOREFS_BIN", DEFAULT_BIN)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"storefs binary not found or not executable: {path} "
                    "(build it, or point STOREFS_BIN at it)", pytrace=False)
    return os.path.abspath(path)


def require_fuse() -> None:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        pytest.fail(f"/dev/fuse is not usable ({exc}); these tests need FUSE", pytrace=False)
    os.close(fd)
    for tool in ("fusermount3", "umount", "mount"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found on PATH; these tests need it", pytrace=False)


def wait_for(cond, timeout: float, step: float = 0.05) -> bool:
    """Whether `cond()` became true within `timeout` seconds (asked every `step`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())


def rfc3339_to_epoch(text: str) -> float:
    """'2026-11-29T19:10:51.952598Z' (0-9 fraction digits) -> seconds since the epoch."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)", text)
    assert m, f"unexpected timestamp format {text!r}"
    base = _dt.datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
    frac = int((m.group(2) or "0").ljust(9, "0")) / 1e9
    return base.timestamp() + frac


# ====================================================================== corpus
@dataclass
class Corpus:
    """What was uploaded to BUCKET: bytes and the server's resource for every object name."""

    data: dict[str, bytes] = field(default_factory=dict)
    resources: dict[str, dict] = field(default_factory=dict)

    BIG = "big/random-24MiB.bin"
    BIG_SIZE = 24 * 1024 * 1024
    GZIP = "enc/compressed.txt.gz"
    ZERO = "files/zero.bin"
    TOKEN = "meta/with token.txt"         # firebaseStorageDownloadTokens "tok-1,tok-2", color=blue
    PLAIN = "meta/plain file+x.txt"       # no tokens, no encoding, no cache control
    PRIVATE = "private/secret.txt"
    ODD = ["odd/with space.txt", "odd/100%.txt", "odd/a+b.txt", "odd/hash#tag.txt",
           "odd/what?.txt", "odd/ünïcødé-日本.txt", "odd/new\nline.txt"]
    LONG_OK = "long/" + "k" * 251 + ".txt"          # component of exactly 255 bytes: visible
    LONG_BAD = "long/" + "n" * 252 + ".txt"         # 256 bytes: hidden
    # Each hidden name's offending component is its first one past a visible directory, so
    # a delimiter listing shows it directly (no directory that is "empty once filtered").
    HIDDEN = ["weird//double.txt", "weird/" + "L" * 256 + ".txt",
              "weird/" + "D" * 300 + "/inside.txt", "/leading-slash.txt", LONG_BAD,
              "weird/nul\x00byte.txt"]   # NUL cannot be in a file name (a C string would cut it)
    DIR1500 = [f"dir1500/f{i:04d}.txt" for i in range(1500)]

    def items(self) -> list[tuple[str, bytes, dict]]:
        """(name, bytes, upload keyword args) for every object, in upload order."""
        rng = random.Random(20261129)
        out: list[tuple[str, bytes, dict]] = [
            ("files/hello.txt", b"hello, storefs\n", {"content_type": "text/plain"}),
            ("files/lines.txt", b"".join(b"line %05d\n" % i for i in range(3000)),
             {"content_type": "text/plain"}),
            (self.ZERO, b"", {}),
            (self.BIG, rng.randbytes(self.BIG_SIZE), {"content_type": "application/octet-stream"}),
            (self.GZIP, gzip.compress(b"storefs keeps stored bytes\n" * 2000, mtime=0),
             {"content_type": "text/plain", "content_encoding": "gzip"}),
            (self.TOKEN, b"download me\n",
             {"content_type": "text/plain; charset=utf-8", "cache_control": "public, max-age=60",
              "metadata": {"firebaseStorageDownloadTokens": "tok-1,tok-2", "color": "blue"}}),
            (self.PLAIN, b"plain\n", {}),
            ("weird/visible.txt", b"visible\n", {}),
            ("empty/", b"", {}),
            ("implicit/deep/file.txt", b"deep file\n", {}),
            ("clash", b"i am shadowed\n", {}),
            ("clash/inner.txt", b"inner\n", {}),
            (self.PRIVATE, b"top secret\n", {}),
            ("private/more/hidden.txt", b"also secret\n", {}),
            (self.LONG_OK, b"255 bytes is fine\n", {}),
        ]
        out += [(n, f"odd {n}\n".encode(), {"content_type": "text/plain"}) for n in self.ODD]
        out += [(n, b"must stay hidden\n", {}) for n in self.HIDDEN]
        out += [(n, f"{n}\n".encode(), {}) for n in self.DIR1500]
        return out

    def upload_all(self, emu: GCSEmulator, bucket: str = BUCKET, workers: int = 16) -> None:
        items = self.items()

        def one(item):
            name, data, kwargs = item
            return name, data, emu.upload(bucket, name, data, **kwargs)

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for name, data, res in pool.map(one, items):
                assert int(res["size"]) == len(data), (name, res["size"], len(data))
                self.data[name] = data
                self.resources[name] = res

    def sha256(self, name: str) -> str:
        return hashlib.sha256(self.data[name]).hexdigest()


# ====================================================================== 403 proxy
FORBIDDEN_BODY = json.dumps({"error": {"code": 403, "message": "Forbidden", "errors": [
    {"domain": "global", "reason": "forbidden", "message": "Forbidden"}]}}).encode()

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailer", "trailers", "transfer-encoding", "upgrade"}
_OBJECT_RE = re.compile(r"^(?:/download)?/storage/v1/b/([^/]+)/o/(.+)$")
_LIST_RE = re.compile(r"^/storage/v1/b/([^/]+)/o/?$")


class _HTTPServer(http.server.ThreadingHTTPServer):
    """socketserver's listen backlog is 5: a client that opens many connections at once (a
    burst of lookups, each with its requests on a connection of its own) had its SYNs past the
    fifth dropped and retried by the kernel after a second, and the fixture, not the client,
    set the pace (measured: 16 stalled lookups, half of them a second late)."""

    request_queue_size = 128


class _TLSHTTPServer(_HTTPServer):
    """A ThreadingHTTPServer whose connections are TLS: the handshake runs in the connection's
    own thread (a slow or failing client never holds up accept), with the context the owner
    has at that moment (`LoopbackServer.tls_context`, so a test can swap it)."""

    daemon_threads = True
    owner: "LoopbackServer"

    def finish_request(self, request, client_address):
        # An owner that tracks its connections (ForbiddingProxy.cut) sees this one from the
        # start of its handshake, so a cut leaves no half-made connection behind.
        track = getattr(self.owner, "track", None)
        request.settimeout(10.0)
        tls = self.owner.tls_context.wrap_socket(request, server_side=True,
                                                 do_handshake_on_connect=False)
        if track:
            track(tls, True)
        try:
            tls.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            self.owner.handshake_failed(f"{type(exc).__name__}: {exc}")
            if track:
                track(tls, False)
            tls.close()
            return
        tls.settimeout(None)
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            try:
                tls.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            tls.close()


class LoopbackServer:
    """A test server of ours on a free 127.0.0.1 port. Subclasses name their request handler
    class (`request_handler`) and thread; the handler reaches this object as `self.owner`.
    `start()` returns self; `stop()` may be called more than once.

    TLS (issue 42): `tls` None means the class default `default_tls`; False is plain http;
    True serves https with the session's `server` certificate (tls_fixture, ALPN `http/1.1`
    only: http.server speaks HTTP/1.1); an `ssl.SSLContext` is used as it is. `endpoint` is
    then `https://127.0.0.1:PORT`. On a TLS server `tls_context` may be replaced while it
    runs; the next connection uses it. `also_plain = True` opens a second, plain-http listener on another
    port with the same handler (`plain_port`, `plain_endpoint`), for what storefs reaches
    over plain http in real life (the GCE metadata server, emulator host variables).
    `handshake_errors` lists failed TLS handshakes.
    """

    thread_name = "loopback-fixture"
    _server: http.server.ThreadingHTTPServer | None = None
    _plain_server: http.server.ThreadingHTTPServer | None = None
    port = 0
    endpoint = ""
    plain_port = 0
    plain_endpoint = ""
    default_tls = False
    tls: "bool | ssl.SSLContext | None" = None
    tls_context: "ssl.SSLContext | None" = None
    also_plain = False
    handshake_errors: "list[str] | tuple" = ()   # a list of this server's own once started

    def request_handler(self) -> type:
        raise NotImplementedError

    def handshake_failed(self, why: str) -> None:
        self.handshake_errors.append(why)     # list.append is atomic: no lock needed

    def start(self):
        handler = type("Handler", (self.request_handler(),), {"owner": self})
        self.handshake_errors = []
        want = self.default_tls if self.tls is None else self.tls
        if isinstance(want, ssl.SSLContext):
            self.tls_context = want
        elif want:
            self.tls_context = tls_fixture.session().server_context("server", tls_fixture.HTTP11)
        else:
            self.tls_context = None
        cls = _TLSHTTPServer if self.tls_context is not None else _HTTPServer
        self._server = cls(("127.0.0.1", 0), handler)
        self._server.owner = self
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name=self.thread_name, daemon=True).start()
        self.port = self._server.server_address[1]
        scheme = "https" if self.tls_context is not None else "http"
        self.endpoint = f"{scheme}://127.0.0.1:{self.port}"
        if self.also_plain:
            self._plain_server = _HTTPServer(("127.0.0.1", 0), handler)
            self._plain_server.daemon_threads = True
            threading.Thread(target=self._plain_server.serve_forever, name=self.thread_name + "-plain",
                             daemon=True).start()
            self.plain_port = self._plain_server.server_address[1]
            self.plain_endpoint = f"http://127.0.0.1:{self.plain_port}"
        return self

    def stop(self) -> None:
        for attr in ("_server", "_plain_server"):
            server = getattr(self, attr)
            if server is not None:
                server.shutdown()
                server.server_close()
                setattr(self, attr, None)

    @staticmethod
    def shutdown_sockets(socks) -> None:
        """Drops client connections still being served (keep-alive ones outlive stop())."""
        for sock in list(socks):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@dataclass
class ProxyRequest:
    kind: str            # list | metadata | media | other
    method: str
    path: str            # raw request target
    name: str | None     # decoded object name (metadata/media)
    prefix: str | None   # decoded prefix (list)
    query: dict[str, list[str]]
    status: int = 0
    range: str | None = None   # the Range header, if any


def classify(method: str, target: str) -> ProxyRequest:
    parts = urllib.parse.urlsplit(target)
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    m = _OBJECT_RE.match(parts.path)
    if m:
        name = urllib.parse.unquote(m.group(2))   # path: '+' stays '+'
        media = parts.path.startswith("/download/") or query.get("alt", [""])[0] == "media"
        return ProxyRequest("media" if media else "metadata", method, target, name, None, query)
    if _LIST_RE.match(parts.path):
        return ProxyRequest("list", method, target, None, query.get("prefix", [""])[0], query)
    return ProxyRequest("other", method, target, None, None, query)


class ForbiddingProxy(LoopbackServer):
    """HTTPS proxy in front of the emulator that answers 403 for everything under `private/`.

    Towards storefs it serves TLS by default (`tls=False` for plain http; see LoopbackServer);
    its upstream hop (inside the test) is whatever `upstream` says: the conftest fixture uses
    the emulator's plain port, an `https://` upstream is reached trusting the session CA.

    Denied: metadata/media requests whose decoded object name starts with `denied_prefix`,
    and list requests whose `prefix` parameter does. Everything else is forwarded: method,
    headers (hop-by-hop ones aside), status and body, streamed. JSON bodies get the
    upstream origin replaced by the proxy's, so `selfLink`/`mediaLink` lead back here (and so
    is each origin in `aliases`: the emulator's links name its https origin whichever port
    was asked). `media_delay` (seconds) holds media responses back, to make a read be "in
    flight".
    """

    default_tls = True

    def __init__(self, upstream: str, denied_prefix: str = "private/", *,
                 tls: "bool | ssl.SSLContext | None" = None, aliases=()) -> None:
        self.upstream = upstream
        self.tls = tls
        self.aliases = [a for a in aliases if a and a != upstream]
        self.denied_prefix = denied_prefix
        self.media_delay = 0.0
        self.media_bytes = 0                     # body bytes of media responses sent to storefs
        self._live: set[socket.socket] = set()   # client connections being served
        self.started: Counter[str] = Counter()   # by kind, counted on arrival
        self.counts: Counter[str] = Counter()    # by kind (+ "denied"), counted once answered
        self.log: list[ProxyRequest] = []
        self._lock = threading.Lock()
        up = urllib.parse.urlsplit(upstream)
        self._up_host, self._up_port = up.hostname, up.port
        self._up_tls = up.scheme == "https"

    # -------------------------------------------------------------- lifecycle
    thread_name = "forbidding-proxy"

    def request_handler(self) -> type:
        return _ProxyHandler

    def cut(self) -> None:
        """The server goes away: stop listening and drop every open connection too.

        `stop()` alone leaves keep-alive connections served by their handler threads, so a
        client with pooled connections would not notice; after `cut()` it sees resets and then
        refused connections.
        """
        self.stop()
        with self._lock:
            live = list(self._live)
        self.shutdown_sockets(live)

    def track(self, sock: socket.socket, alive: bool) -> None:
        with self._lock:
            (self._live.add if alive else self._live.discard)(sock)

    def add_media_bytes(self, n: int) -> None:
        with self._lock:
            self.media_bytes += n

    # -------------------------------------------------------------- queries
    def arrived(self, req: ProxyRequest) -> None:
        with self._lock:
            self.started[req.kind] += 1

    def record(self, req: ProxyRequest) -> None:
        with self._lock:
            self.counts[req.kind] += 1
            if req.status == 403:
                self.counts["denied"] += 1
            self.log.append(req)

    def requests(self, kind: str | None = None) -> list[ProxyRequest]:
        with self._lock:
            return [r for r in self.log if kind is None or r.kind == kind]

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.started.clear()
            self.log.clear()
            self.media_bytes = 0

    def denies(self, req: ProxyRequest) -> bool:
        if req.kind in ("metadata", "media"):
            return req.name is not None and req.name.startswith(self.denied_prefix)
        if req.kind == "list":
            return (req.prefix or "").startswith(self.denied_prefix)
        return False


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    owner: ForbiddingProxy
    protocol_version = "HTTP/1.1"   # keep-alive towards storefs

    def log_message(self, fmt, *args):  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle plus delayed ACK
        # hold every keep-alive answer back ~40 ms and the proxy, not storefs, sets the pace.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.owner.track(self.connection, True)

    def finish(self) -> None:
        self.owner.track(self.connection, False)
        super().finish()
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            if self.owner._up_tls:
                conn = http.client.HTTPSConnection(self.owner._up_host, self.owner._up_port,
                                                   timeout=60, context=tls_fixture.client_context())
            else:
                conn = http.client.HTTPConnection(self.owner._up_host, self.owner._up_port,
                                                  timeout=60)
            self._conn = conn
        return conn

    def _handle(self) -> None:
        req = classify(self.command, self.path)
        req.range = self.headers.get("Range")
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        self.owner.arrived(req)
        if self.owner.denies(req):
            req.status = 403
            self.owner.record(req)
            self.send_response(403)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("Content-Length", str(len(FORBIDDEN_BODY)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(FORBIDDEN_BODY)
            return
        if req.kind == "media" and self.owner.media_delay > 0:
            time.sleep(self.owner.media_delay)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        for attempt in (0, 1):
            conn = self._upstream()
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                self._conn = None
                if attempt:
                    raise
        req.status = resp.status
        self.owner.record(req)
        out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
        ctype = resp.getheader("Content-Type", "")
        no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        self.send_response_only(resp.status, resp.reason)
        if ctype.startswith("application/json") and not no_body:
            data = resp.read()
            for origin in (self.owner.upstream, *self.owner.aliases):
                data = data.replace(origin.encode(), self.owner.endpoint.encode())
            for k, v in out_headers:
                if k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            if req.kind == "media":
                self.owner.add_media_bytes(len(data))
            return
        for k, v in out_headers:
            self.send_header(k, v)
        chunked = resp.getheader("Content-Length") is None and not no_body
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if no_body:
            resp.read()
            return
        while True:
            chunk = resp.read1(256 * 1024)
            if not chunk:
                break
            if chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            else:
                self.wfile.write(chunk)
            if req.kind == "media":
                self.owner.add_media_bytes(len(chunk))
        # read1() does not close a response whose Content-Length it has used up, and
        # http.client refuses the next request's response on this keep-alive connection
        # until it is closed ("ResponseNotReady: Request-sent").
        resp.close()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _safe_handle(self) -> None:
        try:
            self._handle()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            self.close_connection = True   # storefs went away mid-response (unmount, kill)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _safe_handle


# ====================================================================== mounts
def _unescape_mountinfo(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def mount_entries() -> list[tuple[str, str, str]]:
    """(mount point, fstype, source) for every line of /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.rstrip("\n").partition(" - ")
            fields, rest = left.split(" "), right.split(" ")
            out.append((_unescape_mountinfo(fields[4]), rest[0],
                        _unescape_mountinfo(rest[1]) if len(rest) > 1 else ""))
    return out


def mount_at(path: str) -> tuple[str, str, str] | None:
    """The last (top) mount entry at `path`, or None."""
    real = os.path.realpath(path) if not os.path.isabs(path) else os.path.normpath(path)
    found = None
    for entry in mount_entries():
        if entry[0] == real:
            found = entry
    return found


def is_mounted(path: str) -> bool:
    return mount_at(path) is not None


def default_signals() -> None:
    """preexec_fn for a child a test will interrupt: a shell runs background jobs (a CI runner's
    `pytest &`, `nohup`) with SIGINT and SIGQUIT ignored, and children inherit that, so a
    SIGINT the test sends would be ignored by the child, not answered by storefs."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (init may reap daemons late)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_pid_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.02)
    return not pid_alive(pid)


def pids_with_arg(arg: str) -> list[int]:
    """Pids (other than ours) whose argv contains `arg` as a whole argument or -o value."""
    want = arg.encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if want in argv:
            pids.append(int(d))
    return pids


def wait_unmounted(path: str, timeout: float = EXIT_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_mounted(path):
            return True
        time.sleep(0.02)
    return not is_mounted(path)


@dataclass
class Mount:
    """One storefs instance. `path` is the absolute mount point."""

    path: str
    cache_dir: str
    argv: list[str]
    proc: subprocess.Popen | None       # the spawned process (foreground: storefs itself)
    stderr_path: str
    pid: int | None = None              # the storefs process serving the mount
    foreground: bool = True

    def stderr(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def p(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def wait_exit(self, timeout: float = EXIT_TIMEOUT_S) -> int | None:
        """Exit status of a foreground storefs, or None if it is still running."""
        assert self.proc is not None and self.foreground
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


class MountManager:
    """The `mount` fixture: starts storefs instances and always cleans them up.

    Call it: `m = mount(source="test-bucket", options=["stat_ttl=5"], endpoint=None,
    foreground=True, mountpoint=None, cwd=None, cache_dir=None, ca_file=AUTO,
    mount_timeout=MOUNT_TIMEOUT_S)` (cache_dir: reuse an earlier mount's `m.cache_dir`;
    default a fresh empty one; mount_timeout: for mounts that do work of their own first, such
    as indexing a manifest). ca_file: AUTO adds
    `ca_file=<the session CA>` when the endpoint (or an `auth_endpoint=`) is https and the
    options name no `ca_file=` themselves; None adds nothing (a test of what storefs trusts
    without it); a path adds `ca_file=PATH`. `argv(...)` applies the same rule. Teardown unmounts every instance
    (fusermount3 -u, wait by pid up to 10 s, SIGKILL by pid, umount -l if still listed).
    A watchdog kills this test's storefs processes after WATCHDOG_S so a hung FUSE call
    fails the test instead of hanging the suite (`extend_watchdog(seconds)` for a test that
    is long on purpose).
    """

    def __init__(self, emulator_endpoint: str, bin_path: str, ca_file: str | None = None) -> None:
        self.default_endpoint = emulator_endpoint
        self.bin = bin_path
        self.ca_file = ca_file or tls_fixture.session().ca_file
        self.mounts: list[Mount] = []
        self.tmp = tempfile.mkdtemp(prefix="storefs-it-")
        self.watchdog_fired = False
        self._watchdog = threading.Timer(WATCHDOG_S, self._fire_watchdog)
        self._watchdog.daemon = True
        self._watchdog.start()
        self._lock = threading.Lock()
        self._n = 0

    def extend_watchdog(self, seconds: float) -> None:
        """The watchdog fires `seconds` from now instead."""
        self._watchdog.cancel()
        self._watchdog = threading.Timer(seconds, self._fire_watchdog)
        self._watchdog.daemon = True
        self._watchdog.start()

    def new_dir(self, name: str) -> str:
        with self._lock:
            self._n += 1
            d = os.path.join(self.tmp, f"{name}{self._n}")
        os.mkdir(d)
        return d

    def tls_options(self, endpoint: str | None, options, ca_file) -> list[str]:
        """[`ca_file=...`] or [] by the rule in the class doc."""
        if ca_file is None:
            return []
        if ca_file is not AUTO:
            return [f"ca_file={ca_file}"]
        if any(o.startswith("ca_file=") for o in options):
            return []
        urls = [endpoint or ""] + [o.split("=", 1)[1] for o in options
                                   if o.startswith("auth_endpoint=")]
        return [f"ca_file={self.ca_file}"] if any(u.startswith("https://") for u in urls) else []

    def argv(self, source: str, mnt: str, *, endpoint: str | None, options=(), foreground=True,
             cache_dir: str | None = None, ca_file=AUTO) -> tuple[list[str], str]:
        cache_dir = cache_dir or self.new_dir("cache")
        endpoint = endpoint or self.default_endpoint
        opts = [f"endpoint={endpoint}", "anonymous", f"cache_dir={cache_dir}",
                *self.tls_options(endpoint, options, ca_file), *options]
        argv = [self.bin] + (["-f"] if foreground else []) + ["-o", ",".join(opts), source, mnt]
        return argv, cache_dir

    def __call__(self, source: str = BUCKET, *, options=(), endpoint: str | None = None,
                 foreground: bool = True, mountpoint: str | None = None,
                 cwd: str | None = None, preexec_fn=None, cache_dir: str | None = None,
                 ca_file=AUTO, mount_timeout: float = MOUNT_TIMEOUT_S) -> Mount:
        mnt = mountpoint or self.new_dir("mnt")
        abs_mnt = os.path.normpath(os.path.join(cwd or os.getcwd(), mnt))
        argv, cache_dir = self.argv(source, mnt, endpoint=endpoint, options=options,
                                    foreground=foreground, cache_dir=cache_dir, ca_file=ca_file)
        err_path = os.path.join(self.tmp, f"stderr{len(self.mounts)}.txt")
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                    cwd=cwd, start_new_session=True, preexec_fn=preexec_fn)
        m = Mount(abs_mnt, cache_dir, argv, proc, err_path,
                  pid=proc.pid if foreground else None, foreground=foreground)
        self.mounts.append(m)
        deadline = time.monotonic() + mount_timeout
        if foreground:
            while not is_mounted(abs_mnt):
                if proc.poll() is not None:
                    pytest.fail(f"storefs exited with {proc.returncode} before mounting "
                                f"{abs_mnt}\nargv: {argv}\nstderr:\n{m.stderr()}", pytrace=False)
                if time.monotonic() > deadline:
                    pytest.fail(f"{abs_mnt} not mounted after {mount_timeout:.0f} s\n"
                                f"argv: {argv}\nstderr:\n{m.stderr()}", pytrace=False)
                time.sleep(0.02)
        else:
            try:
                rc = proc.wait(timeout=mount_timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"storefs (no -f) did not return within {mount_timeout:.0f} s\n"
                            f"argv: {argv}\nstderr:\n{m.stderr()}", pytrace=False)
            if rc != 0:
                pytest.fail(f"storefs (no -f) exited {rc}\nargv: {argv}\nstderr:\n{m.stderr()}",
                            pytrace=False)
            daemons = [p for p in pids_with_arg(abs_mnt) + pids_with_arg(mnt) if pid_alive(p)]
            m.pid = daemons[0] if daemons else None
        entry = mount_at(abs_mnt)
        assert entry is not None and entry[1] == "fuse.storefs", \
            f"{abs_mnt} mounted with fstype {entry and entry[1]!r}, expected 'fuse.storefs'"
        return m

    def adopt(self, path: str, cache_dir: str, pid: int | None = None) -> Mount:
        """Take over cleanup of a mount made some other way (mount(8))."""
        m = Mount(os.path.abspath(path), cache_dir, [], None, os.devnull, pid=pid,
                  foreground=False)
        self.mounts.append(m)
        return m

    # -------------------------------------------------------------- cleanup
    def _fire_watchdog(self) -> None:
        self.watchdog_fired = True
        for m in list(self.mounts):
            self._kill(m)
            if is_mounted(m.path):
                subprocess.run(["umount", "-l", m.path], capture_output=True, timeout=10)

    def _kill(self, m: Mount) -> None:
        for pid in {m.pid, *pids_with_arg(m.path)} - {None}:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if m.proc is not None and m.proc.poll() is None:
            try:
                m.proc.kill()
            except ProcessLookupError:
                pass

    def unmount(self, m: Mount) -> list[str]:
        """Guaranteed cleanup of one mount; returns complaints (empty when it went cleanly)."""
        problems = []
        if is_mounted(m.path):
            r = subprocess.run(["fusermount3", "-u", m.path], capture_output=True, text=True,
                               timeout=30)
            if r.returncode != 0:
                problems.append(f"fusermount3 -u {m.path}: {r.stderr.strip()}")
        pids = {m.pid} if m.pid else set()
        pids |= set(pids_with_arg(m.path))
        for pid in pids:
            if not wait_pid_gone(pid, EXIT_TIMEOUT_S):
                problems.append(f"storefs pid {pid} still alive {EXIT_TIMEOUT_S:.0f} s after "
                                "unmount; SIGKILL")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                wait_pid_gone(pid, 5)
        if m.proc is not None:
            try:
                m.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(timeout=5)
        if is_mounted(m.path):
            problems.append(f"{m.path} still mounted after the process ended; umount -l")
            subprocess.run(["umount", "-l", m.path], capture_output=True, timeout=30)
        return problems

    def close(self) -> list[str]:
        self._watchdog.cancel()
        problems = []
        for m in reversed(self.mounts):
            try:
                problems += self.unmount(m)
            except Exception as exc:  # keep cleaning the others
                problems.append(f"cleanup of {m.path} failed: {exc!r}")
        for m in self.mounts:
            # Captured output, shown by pytest only when the test failed: a daemon that died
            # (ENOTCONN in the test) says why here, after its directory is gone. Its last
            # lines: a crash's backtrace comes last.
            lines = m.stderr().splitlines()
            if lines:
                print(f"--- storefs stderr, {m.path} (last {min(300, len(lines))} of {len(lines)} lines):",
                      *lines[-300:], sep="\n")
        if not any(is_mounted(m.path) for m in self.mounts):
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.watchdog_fired:
            problems.insert(0, "watchdog: the test held its mounts too long; "
                               "storefs was killed")
        return problems


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str


def run_storefs(argv: list[str], timeout: float = 60.0, **kwargs) -> RunResult:
    """Run storefs to completion (for commands that must fail before mounting)."""
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                           start_new_session=True, **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"storefs did not exit within {timeout:.0f} s: {argv}\n"
                    f"stderr so far: {exc.stderr!r}", pytrace=False)
    return RunResult(r.returncode, r.stdout.decode("utf-8", "replace"),
                     r.stderr.decode("utf-8", "replace"))


def errno_of(fn, *args, **kwargs) -> int | None:
    """Call fn; return the OSError errno it raised, or None if it succeeded."""
    try:
        fn(*args, **kwargs)
    except OSError as exc:
        return exc.errno
    return None


def errname(e: int | None) -> str:
    return "no error" if e is None else errno.errorcode.get(e, str(e))


# ====================================================================== reference namespace
def visible_component(c: str) -> bool:
    return c not in ("", ".", "..") and len(c.encode()) <= 255 and "\0" not in c


def expected_tree(names, prefix: str = "") -> tuple[dict[str, set[str]], dict[str, str]]:
    """The namespace storefs promises (README, "Namespace semantics") for `names` mounted at `prefix`.

    Returns (dirs, files): dirs maps a relative directory path ("" is the root) to its entry
    names; files maps a relative file path to its object name. Directories shadow files;
    names with an invalid component are hidden entirely; `x/` placeholders make dirs.
    """
    dirs: dict[str, set[str]] = {"": set()}
    files: dict[str, str] = {}
    for name in names:
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix):]
        is_dir = rel.endswith("/")
        parts = (rel[:-1] if is_dir else rel).split("/")
        if rel == "" or not all(visible_component(c) for c in parts):
            continue
        for i in range(len(parts) - (0 if is_dir else 1)):
            parent, child = "/".join(parts[:i]), parts[i]
            dirs.setdefault(parent, set()).add(child)
            dirs.setdefault("/".join(parts[:i + 1]), set())
        if not is_dir:
            parent = "/".join(parts[:-1])
            dirs.setdefault(parent, set()).add(parts[-1])
            files["/".join(parts)] = name
    for path in list(files):
        if path in dirs:          # the directory wins
            del files[path]
    return dirs, files


def open_close(path: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> None:
    """open(2) then close: never leaves a descriptor that would keep the mount busy."""
    os.close(os.open(path, flags, mode))


# ====================================================================== reading and checksums
def read_whole(path: str, drop_page_cache: bool = True) -> bytes:
    """Whole file through a fresh descriptor, the kernel's page cache of it dropped first
    (unless told not to), so the bytes really come from storefs (its block cache or the
    network). Bounded: at most 100,000 reads of 1 MiB."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if drop_page_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        for _ in range(100_000):
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli), bitwise and table-driven: independent of the code under test."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@contextlib.contextmanager
def storefs_on_path(storefs_bin: str):
    """mount(8) runs fuse3's mount helper, which runs `storefs` from the default PATH: link the
    binary under test at /usr/local/bin for the duration (refusing to replace another one)."""
    link = "/usr/local/bin/storefs"
    created = False
    if os.path.lexists(link):
        if os.path.realpath(link) != os.path.realpath(storefs_bin):
            pytest.fail(f"{link} exists and is not {storefs_bin} "
                        f"(it resolves to {os.path.realpath(link)}); remove it to run this test",
                        pytrace=False)
    else:
        os.symlink(storefs_bin, link)
        created = True
    try:
        yield
    finally:
        if created:
            os.unlink(link)


def vm_kib(pid: int, field: str) -> int:
    """A /proc/PID/status field in KiB (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


# ====================================================================== bench/link's modelled link
def link_module():
    """bench/link/link.py (LinkProxy, PROFILES), the benchmark's modelled link."""
    d = os.path.join(REPO, "bench", "link")
    if d not in sys.path:
        sys.path.insert(0, d)
    import link
    return link


@contextlib.contextmanager
def link_in_front_of(port: int, tmp_path, profile: str | None = None, **settings):
    """A link proxy (a profile, or these settings) in front of the server on `port`; stopped
    (by pid) when the block ends, however it ends. Plain http: it models the link at the HTTP
    level (it reads each request to log it)."""
    link = link_module()
    kw = dict(workdir=str(tmp_path), log_path=str(tmp_path / "link.log"))
    proxy = link.LinkProxy.profile(profile, port, **kw) if profile else link.LinkProxy(port, **settings, **kw)
    try:
        proxy.start()
    except RuntimeError as exc:
        pytest.fail(f"the link proxy did not start: {exc}", pytrace=False)
    try:
        yield proxy
    finally:
        proxy.stop()


def link_media_requests(proxy) -> list[dict]:
    """Media GETs the link proxy logged since its last reset_stats(), other than the one-byte
    requests that open connections ahead of need."""
    return [r for r in proxy.stats()["per_request"] if "alt=media" in r["path"] and r["range"] != "bytes=0-0"]


def most_at_once(requests: list[dict]) -> int:
    """The most requests (the link proxy's log entries) whose [request, last byte] intervals overlap."""
    events = []
    for r in requests:
        end = r["t_last"] if r["t_last"] is not None else r["t_req"]
        events += [(r["t_req"], 1), (end, -1)]
    most = now = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        now += step
        most = max(most, now)
    return most


# ====================================================================== mounts by descriptor
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)


def fuse_mount(mountpoint: str, uid: int, gid: int, extra: str = "default_permissions,allow_other") -> int:
    """What a CSI node plugin does: open /dev/fuse and mount it at `mountpoint` with fd=N for
    user `uid`; returns the descriptor (close-on-exec: pass it on explicitly)."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    data = f"fd={fd},rootmode=40000,user_id={uid},group_id={gid}" + (f",{extra}" if extra else "")
    if _libc.mount(b"storefs", mountpoint.encode(), b"fuse.storefs",
                   MS_RDONLY | MS_NOSUID | MS_NODEV, data.encode()) != 0:
        err = ctypes.get_errno()
        os.close(fd)
        pytest.fail(f"mount(2) of /dev/fuse at {mountpoint} failed: {os.strerror(err)}", pytrace=False)
    return fd


# ====================================================================== other local users
@contextlib.contextmanager
def throwaway_user(prefix: str, needs: str):
    """A throwaway system user with no home and no shell, named `prefix` + 8 hex digits:
    yields (name, uid, gid); at the end every process it runs is SIGKILLed by pid and the user
    removed. `needs` says in the failure message what wants it (root, useradd, userdel)."""
    for tool in ("useradd", "userdel", "runuser"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: {needs} another local user", pytrace=False)
    if os.getuid() != 0:
        pytest.fail(f"{needs} a throwaway user and mounts: run them as root", pytrace=False)
    name = prefix + uuid.uuid4().hex[:8]
    subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True, timeout=60)
    pw = pwd.getpwnam(name)
    try:
        yield name, pw.pw_uid, pw.pw_gid
    finally:
        kill_processes_of(pw.pw_uid)
        subprocess.run(["userdel", name], capture_output=True, timeout=60)


def kill_processes_of(uid: int) -> None:
    """SIGKILL, by pid, every process `uid` runs (a throwaway user's: all of them the test's)."""
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and os.stat(f"/proc/{d}").st_uid == uid:
                os.kill(int(d), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def metrics_over_unix(path: str) -> bytes:
    """The whole answer to GET /metrics from a `metrics=unix:PATH` socket."""
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(10)
        c.connect(path)
        c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := c.recv(65536):
            answer += chunk
    return answer
