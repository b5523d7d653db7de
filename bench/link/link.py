#!/usr/bin/env python3
"""A WAN link model for the storefs benchmark: Python side of linkproxy.c.

    from link import LinkProxy, PROFILES, measure_overhead

    with LinkProxy.profile("wan", upstream_port=server_port) as link:
        ... point clients at link.url ...
        link.reset_stats()            # start of a phase
        ...
        print(link.stats()["requests"], link.stats()["connections"])

linkproxy listens on 127.0.0.1 only and forwards to 127.0.0.1:upstream_port, adding a
connection setup delay, a per-response time to first byte (on keep-alive connections too) and
per-connection and total download caps (README.md next to this file).

To put the link in front of fake-gcs-server so that its mediaLinks point through the link:
choose the server's port first (a free port), start the LinkProxy with that upstream port
(the server does not need to be up yet: linkproxy connects per client connection), then start
the server with `-external-url link.url`.

Run as a script:
    link.py serve --upstream PORT [--profile wan] [--ttfb-ms N ...]   # standalone, until Ctrl-C
    link.py selftest                                                  # correctness + accuracy
    link.py overhead [--size-mib 512]                                 # cost of the proxy itself
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import http.server
import json
import os
import select
import shutil
import signal
import socket
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time

LINK_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(LINK_DIR, "linkproxy.c")
MIB = 1 << 20

# ttfb: round trip + server time per request; setup: TCP + TLS handshakes (2-3 round trips);
# conn_mibps: what one HTTP/1.1 stream to a cloud bucket gets across a WAN; total: the NIC.
PROFILES = {
    "wan": dict(ttfb_ms=30, conn_mibps=50, total_mibps=1024, setup_ms=60),
    "harsh": dict(ttfb_ms=80, conn_mibps=20, total_mibps=1024, setup_ms=60),
}


def default_workdir() -> str:
    return os.path.join(tempfile.gettempdir(), "storefs-linkproxy")


def build(workdir: str | None = None) -> str:
    """Compiles linkproxy.c into workdir (once per source version) and returns the binary."""
    workdir = workdir or default_workdir()
    os.makedirs(workdir, exist_ok=True)
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    binary = os.path.join(workdir, f"linkproxy-{digest}")
    if os.path.exists(binary):
        return binary
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc) found: apt-get install gcc")
    tmp = f"{binary}.{os.getpid()}.tmp"
    out = subprocess.run([cc, "-O2", "-o", tmp, SOURCE], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{cc} failed on {SOURCE}: {out.stderr.strip()[-600:]}")
    os.replace(tmp, binary)  # atomic: a concurrent build of the same source is harmless
    return binary


def _parse_fields(line: str) -> dict:
    fields = {}
    for part in line.split()[1:]:
        key, _, value = part.partition("=")
        fields[key] = value
    return fields


def _number(value: str):
    if value == "-":
        return None
    try:
        return int(value)
    except ValueError:
        return float(value)


class LinkProxy:
    """One linkproxy process. Times in its log are seconds since the proxy started."""

    def __init__(self, upstream_port: int, ttfb_ms=0, conn_mibps=0, total_mibps=0, setup_ms=0,
                 log_path=None, workdir=None, port: int = 0, splice: bool = True, raw: bool = False):
        self.upstream_port = int(upstream_port)
        self.settings = dict(ttfb_ms=ttfb_ms, conn_mibps=conn_mibps, total_mibps=total_mibps,
                             setup_ms=setup_ms)
        self.workdir = workdir or default_workdir()
        self.log_path = log_path
        self.requested_port = port
        self.splice = splice
        self.raw = raw  # --raw: no HTTP framing (TLS in front of a terminator): setup and caps, no TTFB
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.stderr_path = ""
        self._mark = 0  # log offset where the current stats phase starts

    @classmethod
    def profile(cls, name: str, upstream_port: int, **kw) -> "LinkProxy":
        if name not in PROFILES:
            raise ValueError(f"unknown link profile {name!r}; known: {', '.join(PROFILES)}")
        return cls(upstream_port, **{**PROFILES[name], **kw})

    def command(self, binary: str) -> list[str]:
        s = self.settings
        cmd = [binary, "--upstream", str(self.upstream_port), "--port", str(self.requested_port),
               "--setup-ms", str(s["setup_ms"]), "--ttfb-ms", str(s["ttfb_ms"]),
               "--conn-mibps", str(s["conn_mibps"]), "--total-mibps", str(s["total_mibps"]),
               "--log", self.log_path]
        return cmd + ([] if self.splice else ["--no-splice"]) + (["--raw"] if self.raw else [])

    def start(self, timeout: float = 30.0) -> "LinkProxy":
        binary = build(self.workdir)
        if not self.log_path:
            fd, self.log_path = tempfile.mkstemp(prefix="linkproxy-", suffix=".log", dir=self.workdir)
            os.close(fd)
        open(self.log_path, "ab").close()  # the proxy appends; stats() counts from here
        self._mark = os.path.getsize(self.log_path)
        self.stderr_path = self.log_path + ".stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.command(binary), stdout=subprocess.PIPE, stderr=err,
                                         stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()  # also on Ctrl-C: never leave a proxy behind
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        line = b""
        deadline = time.monotonic() + timeout
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            chunk = os.read(self.proc.stdout.fileno(), 64) if ready else b""
            if not chunk:  # exited (stop() reaps it) or silent past the timeout
                raise RuntimeError(f"linkproxy did not start: {self._stderr_tail()}")
            line += chunk
        if not line.startswith(b"READY "):
            raise RuntimeError(f"linkproxy said {line!r}: {self._stderr_tail()}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def _stderr_tail(self) -> str:
        try:
            with open(self.stderr_path, errors="replace") as f:
                return f.read()[-600:].strip()
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM by pid (linkproxy writes its summary), then SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        if not proc:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=5)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        if proc.stdout:
            proc.stdout.close()

    def counters(self, timeout: float = 5.0) -> dict:
        """The proxy's running totals now (SIGUSR1 -> a 'summary' line in the log): t (its
        clock), connections, active, requests, responses, bytes_down, bytes_up."""
        start = os.path.getsize(self.log_path)
        os.kill(self.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                for line in f.read().decode(errors="replace").splitlines():
                    if line.startswith("summary reason=usr1 "):
                        return {k: _number(v) for k, v in _parse_fields(line).items() if k != "reason"}
            time.sleep(0.002)
        raise RuntimeError("linkproxy did not answer SIGUSR1")

    def remove_log(self) -> None:
        """Deletes the log (and the stderr beside it); stats() has nothing to read after this."""
        for path in (self.log_path, self.stderr_path):
            if path and os.path.exists(path):
                os.unlink(path)

    def reset_stats(self) -> None:
        """Starts a new phase: stats() counts only what is logged from now on."""
        self._mark = os.path.getsize(self.log_path)

    def stats(self) -> dict:
        """What was logged since the last reset_stats(): connections opened (and closed),
        requests (answered or cut short: `incomplete`; a request is logged when its response
        ends), bytes sent to clients (`bytes` with response heads, `body_bytes` without).
        `per_request`: one dict per request, times in seconds since the proxy started
        (t_first/t_last None if no byte went out)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._mark)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]  # only whole lines
        per_request, opened, closed = [], 0, 0
        for raw in data.decode(errors="replace").splitlines():
            kind = raw.split(" ", 1)[0]
            if kind == "open":
                opened += 1
            elif kind == "close":
                closed += 1
            elif kind == "req":
                f = _parse_fields(raw)
                for key in ("conn", "seq", "status", "bytes", "body", "done", "t_req", "t_first", "t_last"):
                    f[key] = _number(f[key])
                per_request.append(f)
        return {
            "connections": opened,
            "closed": closed,
            "requests": len(per_request),
            "incomplete": sum(1 for r in per_request if not r["done"]),
            "bytes": sum(r["bytes"] for r in per_request),
            "body_bytes": sum(r["body"] for r in per_request),
            "connections_used": len({r["conn"] for r in per_request}),
            "per_request": per_request,
        }

    def __enter__(self) -> "LinkProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------- measuring

def _curl(args: list[str], timeout: float = 600) -> str:
    out = subprocess.run(["curl", "-sS", "--fail"] + args, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"curl {' '.join(args[:6])}... failed: {out.stderr.strip()[-300:]}")
    return out.stdout


def curl_one_stream(url: str, size: int) -> float:
    """MiB/s of one GET of the whole object."""
    t = float(_curl(["-o", "/dev/null", "-w", "%{time_total}", url]))
    return size / MIB / t


def curl_parallel(url: str, size: int, streams: int) -> float:
    """MiB/s of `streams` ranged GETs at once, one slice each: size / wall time."""
    part = size // streams
    procs = []
    start = time.monotonic()
    for i in range(streams):
        last = size - 1 if i == streams - 1 else (i + 1) * part - 1
        procs.append(subprocess.Popen(["curl", "-sS", "--fail", "-o", "/dev/null", "-r",
                                       f"{i * part}-{last}", url]))
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise RuntimeError(f"curl -r on {url} failed")
    return size / MIB / (time.monotonic() - start)


def curl_keepalive_latency(url: str, count: int = 320, warmup: int = 20, rng: str = "0-4095") -> dict:
    """Per-request times of `count` small ranged GETs on one reused curl connection."""
    args = ["-r", rng, "-w", "%{time_starttransfer} %{time_total} %{num_connects}\n"]
    for _ in range(count):
        args += ["-o", "/dev/null", url]
    rows = [line.split() for line in _curl(args).splitlines()]
    totals = [float(r[1]) for r in rows[warmup:]]
    return {"p50_us": statistics.median(totals) * 1e6,
            "first_us": [float(r[0]) * 1e6 for r in rows[:3]],
            "connects": sum(int(r[2]) for r in rows)}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_overhead(upstream_port: int, object_url_path: str, size: int, runs: int = 3,
                     streams: int = 16, small_requests: int = 320, workdir=None) -> dict:
    """The proxy's own cost: the same curl measurements direct and through a linkproxy with
    no delays and no caps, interleaved run by run; medians over `runs`. Also the proxy's CPU
    seconds per GiB it forwarded (1 and `streams` streams together)."""
    direct = f"http://127.0.0.1:{upstream_port}{object_url_path}"
    result = {"size_mib": size / MIB, "runs": runs, "streams": streams}
    link = LinkProxy(upstream_port, workdir=workdir).start()
    try:
        proxied = link.url + object_url_path
        samples: dict[str, list[float]] = {}
        cpu = 0.0
        for _ in range(runs):
            for name, url in (("direct", direct), ("proxy", proxied)):
                cpu0 = _cpu_seconds(link.proc.pid)
                samples.setdefault(f"{name}_1_mibps", []).append(curl_one_stream(url, size))
                samples.setdefault(f"{name}_{streams}_mibps", []).append(curl_parallel(url, size, streams))
                cpu += _cpu_seconds(link.proc.pid) - cpu0
                samples.setdefault(f"{name}_request_us", []).append(
                    curl_keepalive_latency(url, small_requests)["p50_us"])
        result["proxy_cpu_s_per_gib"] = cpu / (2 * runs * size / (1 << 30))
    finally:
        link.stop()
        link.remove_log()
    for key, values in samples.items():
        result[key] = statistics.median(values)
        result[key + "_all"] = [round(v, 1) for v in values]
    result["ratio_1"] = result["proxy_1_mibps"] / result["direct_1_mibps"]
    result[f"ratio_{streams}"] = result[f"proxy_{streams}_mibps"] / result[f"direct_{streams}_mibps"]
    result["added_us_per_request"] = result["proxy_request_us"] - result["direct_request_us"]
    return result


# ------------------------------------------------------------------- a local test server

class _TestHandler(http.server.BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1 with the framings the proxy must follow:
    /file/NAME (Range, sendfile, HEAD), /chunked?n=&chunk=, /close?n= (body until close),
    /nocontent (204), POST /echo (Content-Length or chunked body -> its length and sha256)."""

    protocol_version = "HTTP/1.1"
    root = "."

    def setup(self):
        super().setup()
        # headers and body are separate writes: without this, Nagle + delayed ACK add 40 ms
        # (Go's net/http, i.e. fake-gcs-server, sets TCP_NODELAY too)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._serve(send_body=True)

    def do_HEAD(self):
        self._serve(send_body=False)

    def _query(self) -> dict:
        _, _, q = self.path.partition("?")
        return dict(p.split("=", 1) for p in q.split("&") if "=" in p)

    def _serve(self, send_body: bool):
        path = self.path.split("?")[0]
        if path.startswith("/file/"):
            return self._serve_file(os.path.join(self.root, os.path.basename(path)), send_body)
        if path == "/chunked":
            q = self._query()
            n, chunk = int(q.get("n", 100000)), int(q.get("chunk", 4096))
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if send_body:
                data = _pattern(n)
                for i in range(0, n, chunk):
                    piece = data[i:i + chunk]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.write(b"0\r\nX-Trailer: yes\r\n\r\n")
            return
        if path == "/close":
            n = int(self._query().get("n", 100000))
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            if send_body:
                self.wfile.write(_pattern(n))
            self.close_connection = True
            return
        if path == "/nocontent":
            self.send_response(204)
            self.end_headers()
            return
        self.send_error(404)

    def _serve_file(self, name: str, send_body: bool):
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:
            return self.send_error(404)
        try:
            size = os.fstat(fd).st_size
            start, end = 0, size - 1
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start, end = int(a), min(int(b) if b else size - 1, size - 1)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(end - start + 1))
            self.end_headers()
            if send_body:
                offset, left = start, end - start + 1
                while left > 0:
                    sent = os.sendfile(self.connection.fileno(), fd, offset, left)
                    if sent == 0:
                        break
                    offset += sent
                    left -= sent
        finally:
            os.close(fd)

    def do_POST(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        reply = json.dumps({"len": len(body), "sha256": hashlib.sha256(body).hexdigest()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


def _pattern(n: int) -> bytes:
    block = hashlib.sha256(b"linkproxy").digest() * 128  # 4 KiB, not compressible by eye
    return (block * (n // len(block) + 1))[:n]


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # resets are part of the tests
            super().handle_error(request, client_address)


def run_test_server(root: str) -> None:
    """Serves root on a free 127.0.0.1 port; prints 'READY <port>'."""
    _TestHandler.root = root
    server = _Server(("127.0.0.1", 0), _TestHandler)
    print(f"READY {server.server_address[1]}", flush=True)
    server.serve_forever()


class TestServer:
    """run_test_server() in a child process (so its CPU is not the caller's GIL's)."""

    def __init__(self, root: str):
        self.root = root
        self.proc = None
        self.port = 0

    def __enter__(self) -> "TestServer":
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "testserver", self.root],
                                     stdout=subprocess.PIPE)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != b"READY":
            raise RuntimeError("test server did not start")
        self.port = int(line[1])
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        self.proc.stdout.close()


def make_test_file(path: str, size: int) -> None:
    """Random-looking bytes, made fast: 1 MiB of random data repeated with a counter."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    block = os.urandom(MIB)
    with open(path + ".tmp", "wb") as f:
        for i in range(0, size, MIB):
            f.write((i // MIB).to_bytes(8, "little") + block[8:MIB] if size - i >= MIB else block[: size - i])
    os.replace(path + ".tmp", path)


# ------------------------------------------------------------------------------ self test

def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            h.update(chunk)
    return h.hexdigest()


def _raw_exchange(port: int, payload: bytes, shut_write: bool = False, timeout: float = 10) -> bytes:
    """Sends payload on a new connection, reads until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = s.recv(MIB)
            if not chunk:
                return data
            data += chunk


def _check(ok: bool, what: str, failures: list) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)


_test_dirs = {"logs": None, "work": None}


def _test_log() -> str:
    """A fresh log file in the self-test's temp dir (removed with it)."""
    fd, path = tempfile.mkstemp(prefix="linkproxy-", suffix=".log", dir=_test_dirs["logs"])
    os.close(fd)
    return path


def _test_link(upstream: int, **settings) -> LinkProxy:
    return LinkProxy(upstream, log_path=_test_log(), workdir=_test_dirs["work"], **settings)


def selftest_correctness(port: int, upstream: int, root: str, failures: list) -> None:
    big = os.path.join(root, "data.bin")
    base = f"http://127.0.0.1:{port}"
    out = subprocess.run(["curl", "-sS", "--fail", f"{base}/file/data.bin"], capture_output=True)
    _check(hashlib.sha256(out.stdout).hexdigest() == _sha256_file(big), "whole object, bytes identical",
           failures)
    out = subprocess.run(["curl", "-sS", "--fail", "-r", "1000-2000999", f"{base}/file/data.bin"],
                         capture_output=True)
    with open(big, "rb") as f:
        f.seek(1000)
        _check(out.stdout == f.read(2000000), "ranged GET (206), bytes identical", failures)
    for chunk in (1, 100, 4096, 300000):
        out = subprocess.run(["curl", "-sS", "--fail", "--raw", f"{base}/chunked?n=1000000&chunk={chunk}",
                              "-o", "/dev/null", f"{base}/chunked?n=5000&chunk={chunk}"],
                             capture_output=True)
        plain = subprocess.run(["curl", "-sS", "--fail", f"{base}/chunked?n=1000000&chunk={chunk}"],
                               capture_output=True)
        _check(out.returncode == 0 and plain.stdout == _pattern(1000000),
               f"chunked response, {chunk}-byte chunks + trailer, then a second one on the connection",
               failures)
    fmt = "%{num_connects} %{http_code} "
    out = subprocess.run(["curl", "-sS", "--fail", "-I", "-o", "/dev/null", "-w", fmt,
                          f"{base}/file/data.bin",
                          "--next", "-sS", "-o", "/dev/null", "-w", fmt, f"{base}/nocontent",
                          "--next", "-sS", "-r", "0-9", "-o", "/dev/null", "-w", fmt,
                          f"{base}/file/data.bin"], capture_output=True, text=True)
    _check(out.stdout.strip() == "1 200 0 204 0 206",
           f"HEAD (no body), 204, then a GET, one connection: {out.stdout.strip()!r}", failures)
    out = subprocess.run(["curl", "-sS", f"{base}/close?n=3000000"], capture_output=True)
    _check(out.stdout == _pattern(3000000), "body delimited by close", failures)
    payload = os.urandom(5 * MIB + 17)
    for extra in ([], ["-H", "Transfer-Encoding: chunked"]):
        out = subprocess.run(["curl", "-sS", "--fail", "--data-binary", "@-", *extra, f"{base}/echo",
                              "--next", "-sS", "-r", "0-9", "-o", "/dev/null", "-w", "%{num_connects}",
                              f"{base}/file/data.bin"], input=payload, capture_output=True)
        text = out.stdout.decode()
        echo = json.loads(text[: text.rfind("}") + 1])
        _check(text.endswith("}0"), "the GET after the upload reused the connection", failures)
        _check(echo == {"len": len(payload), "sha256": hashlib.sha256(payload).hexdigest()},
               f"POST 5 MiB upload {'chunked' if extra else 'Content-Length'}, then a GET", failures)
    req = b"GET /file/data.bin HTTP/1.1\r\nHost: x\r\nRange: bytes=0-99\r\n\r\n"
    last = b"GET /chunked?n=70000&chunk=999 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    data = _raw_exchange(port, req * 3 + last)
    _check(data.count(b"HTTP/1.1 206") == 3 and data.count(b"HTTP/1.1 200") == 1
           and data.endswith(b"0\r\nX-Trailer: yes\r\n\r\n"), "4 pipelined requests in one write", failures)
    data = _raw_exchange(port, b"GET /file/data.bin HTTP/1.1\r\nHost: x\r\nRange: bytes=0-9\r\n\r\n",
                         shut_write=True)
    _check(data.startswith(b"HTTP/1.1 206") and data.endswith(_head_bytes(big, 10)),
           "client half-close after the request: response still delivered", failures)
    # a reset mid-transfer must not hurt the proxy
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /file/data.bin HTTP/1.1\r\nHost: x\r\n\r\n")
    s.recv(65536)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()
    out = subprocess.run(["curl", "-sS", "--fail", "-r", "0-9", f"{base}/file/data.bin"], capture_output=True)
    _check(out.stdout == _head_bytes(big, 10), "client reset mid-transfer; the next request works", failures)
    # many connections at once, each with a request in flight
    socks = []
    for _ in range(300):
        c = socket.create_connection(("127.0.0.1", port), timeout=30)
        c.sendall(b"GET /file/data.bin HTTP/1.1\r\nHost: x\r\nRange: bytes=0-65535\r\n"
                  b"Connection: close\r\n\r\n")
        socks.append(c)
    good = 0
    for c in socks:
        data = b""
        while True:
            chunk = c.recv(MIB)
            if not chunk:
                break
            data += chunk
        good += data.startswith(b"HTTP/1.1 206") and data.endswith(_head_bytes(big, 65536))
        c.close()
    _check(good == 300, f"300 concurrent connections: {good} complete", failures)
    secret = "s3cr3tTOKENvalue"
    subprocess.run(["curl", "-sS", "-o", "/dev/null",
                    f"{base}/file/data.bin?alt=media&token={secret}&X-Goog-Signature={secret}"])


def _head_bytes(path: str, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _median_of(n: int, fn):
    return statistics.median(fn() for _ in range(n))


def selftest_accuracy(upstream: int, root: str, workdir: str, failures: list, runs: int = 3) -> None:
    url_path = "/file/data.bin"
    size = os.path.getsize(os.path.join(root, "data.bin"))

    print("  TTFB 30 ms, one reused connection, 20 x 4 KiB ranged GETs "
          "(time_starttransfer per request, ms):")
    with _test_link(upstream, ttfb_ms=30) as link:
        meds = []
        for _ in range(runs):
            args = ["-r", "0-4095", "-w", "%{time_starttransfer} %{time_total} %{num_connects}\n"]
            for _ in range(20):
                args += ["-o", "/dev/null", link.url + url_path]
            rows = [list(map(float, r.split())) for r in _curl(args).splitlines()]
            meds.append(statistics.median(r[0] * 1000 for r in rows[1:]))
            connects = sum(r[2] for r in rows)
        log = link.stats()["per_request"]
        gaps = [(r["t_first"] - r["t_req"]) * 1000 for r in log]
        print(f"    client: median {statistics.median(meds):.2f} ms "
              f"(runs {', '.join(f'{m:.2f}' for m in meds)}), "
              f"connections {connects:.0f} per 20 requests; proxy log t_first - t_req: "
              f"median {statistics.median(gaps):.3f} ms, max {max(gaps):.3f}")
        _check(29.5 < statistics.median(meds) < 32 and connects == 1, "TTFB on a keep-alive connection",
               failures)

    print("  setup 60 ms + TTFB 30 ms, new connection (time_connect / time_starttransfer, ms):")
    with _test_link(upstream, ttfb_ms=30, setup_ms=60) as link:
        rows = []
        for _ in range(runs):
            out = _curl(["-r", "0-4095", "-o", "/dev/null", "-w", "%{time_connect} %{time_starttransfer}",
                         link.url + url_path])
            rows.append([float(x) * 1000 for x in out.split()])
        conn = statistics.median(r[0] for r in rows)
        first = statistics.median(r[1] for r in rows)
        print(f"    time_connect {conn:.2f} ms, time_starttransfer {first:.2f} ms "
              f"(runs {', '.join(f'{r[1]:.2f}' for r in rows)})")
        _check(89.5 < first < 93, "setup + TTFB on a new connection", failures)

    for cap in (50, 20, 200):
        with _test_link(upstream, conn_mibps=cap) as link:
            n = min(size, cap * MIB * 2)  # ~2 s
            speeds = [float(_curl(["-r", f"0-{n - 1}", "-o", "/dev/null", "-w", "%{speed_download}",
                                   link.url + url_path])) / MIB for _ in range(runs)]
            med = statistics.median(speeds)
            print(f"  per-connection cap {cap} MiB/s, one {n // MIB} MiB GET: {med:.2f} MiB/s "
                  f"(runs {', '.join(f'{s:.2f}' for s in speeds)})")
            _check(abs(med / cap - 1) < 0.03, f"per-connection cap {cap} MiB/s within 3%", failures)

    n = 64 * MIB
    with LinkProxy.profile("wan", upstream, workdir=_test_dirs["work"], log_path=_test_log()) as link:
        p = PROFILES["wan"]
        rows = []
        for _ in range(runs):
            out = _curl(["-r", f"0-{n - 1}", "-o", "/dev/null", "-w", "%{time_starttransfer} %{time_total}",
                         link.url + url_path])
            rows.append([float(x) * 1000 for x in out.split()])
        first, total = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        expect = p["setup_ms"] + p["ttfb_ms"] + n / MIB / p["conn_mibps"] * 1000
        print(f"  profile 'wan', one 64 MiB GET on a new connection: first byte {first:.1f} ms, "
              f"total {total:.1f} ms "
              f"(model: {p['setup_ms'] + p['ttfb_ms']} and {expect:.0f} ms)")
        _check(abs(total / expect - 1) < 0.03, "profile 'wan' end to end within 3%", failures)

    with _test_link(upstream, conn_mibps=50) as link:
        rates = window_rates(link.port, url_path, 100 * MIB)
        q = statistics.quantiles(rates, n=100)
        print(f"  smoothness, cap 50 MiB/s, one 100 MiB GET read by a socket loop, MiB/s per 10 ms window "
              f"({len(rates)} windows): p1 {q[0]:.1f}, p50 {q[49]:.1f}, p99 {q[98]:.1f}, "
              f"min {min(rates):.1f}, "
              f"max {max(rates):.1f}")
        _check(q[4] > 40 and q[94] < 60,
               "50 MiB/s cap smooth at 10 ms: p5..p95 of windows within 40-60 MiB/s", failures)

    for total, conn_cap, streams in ((256, 50, 16), (1024, 50, 16), (100, 0, 16)):
        with _test_link(upstream, conn_mibps=conn_cap, total_mibps=total) as link:
            expect = min(total, conn_cap * streams) if conn_cap else total
            n = min(size, int(expect * MIB * 3))  # up to ~3 s
            duration = n / MIB / expect
            aggs, spreads, walls = [], [], []
            for _ in range(runs):
                link.reset_stats()
                box: dict = {}
                t = threading.Thread(
                    target=lambda: box.update(wall=curl_parallel(link.url + url_path, n, streams)))
                t.start()
                # the link's own byte counter over the middle half, when every stream runs
                time.sleep(duration / 4)
                a = link.counters()
                time.sleep(duration / 2)
                b = link.counters()
                t.join()
                walls.append(box["wall"])
                aggs.append((b["bytes_down"] - a["bytes_down"]) / MIB / (b["t"] - a["t"]))
                per = sorted(r["body"] / MIB / (r["t_last"] - r["t_first"])
                             for r in link.stats()["per_request"])
                spreads.append((per[0], per[-1]))
            med = statistics.median(aggs)
            lo, hi = spreads[len(spreads) // 2]
            print(f"  total cap {total} MiB/s, conn cap {conn_cap or 'off'}, "
                  f"{streams} parallel ranged curls of "
                  f"{n // MIB // streams} MiB: {med:.1f} MiB/s over the middle half (expect {expect}; runs "
                  f"{', '.join(f'{a:.1f}' for a in aggs)}; whole transfer by wall clock "
                  f"{statistics.median(walls):.1f}); per stream {lo:.1f}-{hi:.1f} MiB/s")
            _check(abs(med / expect - 1) < 0.03, f"aggregate {expect} MiB/s within 3%", failures)


def window_rates(port: int, url_path: str, nbytes: int, window: float = 0.01) -> list[float]:
    """MiB/s in each `window` seconds of one GET of nbytes, read by a plain socket loop,
    from the first to the last body byte (first and last windows dropped)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"GET {url_path} HTTP/1.1\r\nHost: x\r\nRange: bytes=0-{nbytes - 1}\r\n"
                  f"Connection: close\r\n\r\n".encode())
        buckets: dict[int, int] = {}
        start = None
        while True:
            data = s.recv(MIB)
            if not data:
                break
            now = time.monotonic()
            start = start or now
            key = int((now - start) / window)
            buckets[key] = buckets.get(key, 0) + len(data)
    keys = range(1, max(buckets))
    return [buckets.get(k, 0) / MIB / window for k in keys]


def selftest(args) -> int:
    workdir = args.workdir or default_workdir()
    os.makedirs(workdir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="linkproxy-test-", dir=workdir)
    _test_dirs.update(logs=root, work=workdir)
    failures: list[str] = []
    try:
        make_test_file(os.path.join(root, "data.bin"), args.size_mib * MIB)
        with TestServer(root) as server:
            if not args.no_correctness:
                print("correctness (through a linkproxy with ttfb 2 ms, conn cap 400 MiB/s, total 1000):")
                with _test_link(server.port, ttfb_ms=2, conn_mibps=400, total_mibps=1000) as link:
                    selftest_correctness(link.port, server.port, root, failures)
                    time.sleep(0.3)
                    text = open(link.log_path).read()
                    _check("s3cr3t" not in text and "alt=media" in text,
                           "no token/signature values in the log", failures)
                    st = link.stats()
                    print(f"    log: {st['connections']} connections, {st['requests']} requests, "
                          f"{st['incomplete']} cut short, {st['bytes'] / MIB:.1f} MiB to clients")
                print("correctness, same checks with no shaping at all:")
                with _test_link(server.port) as link:
                    selftest_correctness(link.port, server.port, root, failures)
                print("correctness, same checks with --no-splice:")
                with _test_link(server.port, ttfb_ms=1, splice=False) as link:
                    selftest_correctness(link.port, server.port, root, failures)
            if not args.no_accuracy:
                print(f"accuracy (median of {args.runs}):")
                selftest_accuracy(server.port, root, workdir, failures, args.runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("FAILED: " + "; ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


def overhead(args) -> int:
    workdir = args.workdir or default_workdir()
    os.makedirs(workdir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="linkproxy-test-", dir=workdir)
    try:
        make_test_file(os.path.join(root, "data.bin"), args.size_mib * MIB)
        with TestServer(root) as server:
            r = measure_overhead(server.port, "/file/data.bin", args.size_mib * MIB, runs=args.runs,
                                 workdir=workdir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(r, indent=1))
    s = r["streams"]
    print(f"1 stream:  direct {r['direct_1_mibps']:.0f} MiB/s, "
          f"through linkproxy {r['proxy_1_mibps']:.0f} MiB/s "
          f"({r['ratio_1']:.2f}x)\n{s} streams: direct {r[f'direct_{s}_mibps']:.0f} MiB/s, through linkproxy "
          f"{r[f'proxy_{s}_mibps']:.0f} MiB/s ({r[f'ratio_{s}']:.2f}x)\n4 KiB keep-alive GET p50: direct "
          f"{r['direct_request_us']:.0f} us, through linkproxy {r['proxy_request_us']:.0f} us "
          f"(+{r['added_us_per_request']:.0f} us)")
    return 0


def serve(args) -> int:
    given = dict(ttfb_ms=args.ttfb_ms, conn_mibps=args.conn_mibps, total_mibps=args.total_mibps,
                 setup_ms=args.setup_ms)
    kw = {k: v for k, v in given.items() if v is not None}
    link = (LinkProxy.profile(args.profile, args.upstream, port=args.port, log_path=args.log, **kw)
            if args.profile else LinkProxy(args.upstream, port=args.port, log_path=args.log, **kw))
    def interrupt(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)  # SIGINT may be ignored in a background job
    with link:
        print(f"{link.url} -> 127.0.0.1:{args.upstream} {link.settings}; log {link.log_path}; "
              "Ctrl-C or SIGTERM stops", flush=True)
        try:
            link.proc.wait()
        except KeyboardInterrupt:
            pass
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run a link in front of 127.0.0.1:UPSTREAM until Ctrl-C")
    s.add_argument("--upstream", type=int, required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--profile", choices=sorted(PROFILES))
    for name in ("ttfb-ms", "conn-mibps", "total-mibps", "setup-ms"):
        s.add_argument(f"--{name}", type=float)
    s.add_argument("--log")
    for name, fn in (("selftest", selftest), ("overhead", overhead)):
        t = sub.add_parser(name)
        t.add_argument("--size-mib", type=int, default=512 if name == "overhead" else 256)
        t.add_argument("--runs", type=int, default=3)
        t.add_argument("--workdir")
        if name == "selftest":
            t.add_argument("--no-accuracy", action="store_true")
            t.add_argument("--no-correctness", action="store_true")
        t.set_defaults(fn=fn)
    s.set_defaults(fn=serve)
    t = sub.add_parser("testserver")
    t.add_argument("root")
    t.set_defaults(fn=lambda a: run_test_server(a.root))
    args = p.parse_args()
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
