"""--tls: every client reaches the bucket over real TLS, as it reaches Google (bench/README.md "--tls").

- `make_pki`: a throwaway CA and a server certificate for 127.0.0.1 (ECDSA P-256, as Google
  serves), made with the openssl CLI in the run's work dir; every client is given the CA by its
  own option (storefs `ca_file=`, curl `--cacert`, rclone `--ca-cert`, floorfs
  `FLOORFS_CA_FILE`), never through the system store.
- Loopback: fake-gcs-server itself serves https (`-scheme both`: Go's TLS server, which offers
  h2 by ALPN, on one port; plain http on another, used only to measure what TLS costs).
- `--link`: `TlsLink`, a chain that keeps every part of the link model per client connection:

      client --TLS--> linkproxy --raw (setup, caps) --> nginx (TLS, h2 + http/1.1)
             --http/1.1 keep-alive--> linkproxy (TTFB only) --> fake-gcs-server (http)

  The front proxy sees only TLS bytes, so it models what is per connection (the set-up delay,
  the per-connection and total caps) on the client's own connection: an h2 connection that
  multiplexes 16 streams gets one connection's cap, as one TCP connection across a WAN does.
  The back proxy sees HTTP/1.1 again (nginx speaks it upstream), so every request, every h2
  stream included, waits its own TTFB. Its connections are nginx's pooled ones: no set-up delay
  there, no cap. The TLS handshake's own round trips pay nothing extra: the front proxy's
  set-up delay (60 ms) is what the profile already charges a new connection for TCP + TLS.
- `https_walk`: the direct listing walk (Tests/integration/scale_server.py's `walk()`, which
  opens an http.client connection) over TLS, without copying it.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import ssl
import subprocess
import time
import types

from .host import BenchError, ServerProcess, at_cleanup, free_port, log

HTTP_VERSIONS = ("1.1", "2")


# --------------------------------------------------------------------------- certificates
class Pki:
    """The files of a throwaway CA and of a server certificate it signed (for 127.0.0.1)."""

    def __init__(self, d: str):
        self.dir = d
        self.ca = os.path.join(d, "ca.pem")
        self.ca_key = os.path.join(d, "ca.key")
        self.cert = os.path.join(d, "server.pem")
        self.key = os.path.join(d, "server.key")
        self.description = ""

    def ssl_context(self) -> ssl.SSLContext:
        """A client context that trusts this CA only (Python clients of the bench)."""
        return ssl.create_default_context(cafile=self.ca)


def _openssl(args: list, cwd: str) -> None:
    out = subprocess.run(["openssl"] + args, cwd=cwd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise BenchError(f"openssl {' '.join(args[:2])} failed: {out.stderr.strip()[-400:]}")


def make_pki(workdir: str) -> Pki:
    """CA (2 days) and server certificate (SAN IP:127.0.0.1, DNS:localhost) in workdir/tls."""
    p = Pki(os.path.join(workdir, "tls"))
    os.makedirs(p.dir)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(["req", "-x509"] + ec + ["-keyout", p.ca_key, "-out", p.ca, "-days", "2",
                                      "-subj", "/CN=storefs bench throwaway CA",
                                      "-addext", "basicConstraints=critical,CA:TRUE",
                                      "-addext", "keyUsage=critical,keyCertSign,cRLSign"], p.dir)
    csr = os.path.join(p.dir, "server.csr")
    _openssl(["req", "-new"] + ec + ["-keyout", p.key, "-out", csr, "-subj", "/CN=127.0.0.1"], p.dir)
    ext = os.path.join(p.dir, "server.ext")
    with open(ext, "w") as f:
        f.write("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(["x509", "-req", "-in", csr, "-CA", p.ca, "-CAkey", p.ca_key, "-CAcreateserial",
              "-out", p.cert, "-days", "2", "-extfile", ext], p.dir)
    p.description = "throwaway CA + server certificate for 127.0.0.1, ECDSA P-256, made by openssl in the work dir"
    return p


# --------------------------------------------------------------------------- the TLS terminator (--link)
def nginx_binary() -> str:
    env = os.environ.get("NGINX_BIN")
    if env:
        return env
    for cand in ("/usr/sbin/nginx", "/usr/bin/nginx"):
        if os.access(cand, os.X_OK):
            return cand
    raise BenchError("--link --tls needs nginx as its TLS terminator: apt-get install nginx-core "
                     "(or set NGINX_BIN)")


NGINX_CONF = """\
# bench/run --tls: the TLS terminator of the modelled link. Written per run; nothing else reads it.
daemon off;
master_process on;
worker_processes {workers};
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    log_format bench '$server_port $server_protocol $status $body_bytes_sent';
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    # Google keeps a connection for as many requests as it is given: so do we.
    keepalive_requests 1000000;
    keepalive_timeout 600s;
    http2_max_requests 1000000;
    http2_max_concurrent_streams 128;
    http2_chunk_size 16k;   # DATA frames of 16 KiB, the HTTP/2 default SETTINGS_MAX_FRAME_SIZE
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    ssl_session_cache off;
{upstreams}
{servers}
}}
"""

# fake-gcs-server writes the mediaLinks of a listing (which rclone downloads from) from the
# request's Host and its own scheme (http): the clients' origin is sent as Host, and the scheme
# of those links made https again. JSON only: object bodies are never filtered.
NGINX_REWRITE = """\
            sub_filter '"mediaLink":"http://' '"mediaLink":"https://';
            sub_filter_once off;
            sub_filter_types application/json;
"""

NGINX_UPSTREAM = """\
    upstream {name} {{ server 127.0.0.1:{port}; keepalive 256; keepalive_requests 1000000; keepalive_timeout 600s; }}
"""

NGINX_SERVER = """\
    server {{
        listen 127.0.0.1:{port}{tls};
        access_log {dir}/access-{port}.log bench;
        location / {{
            proxy_pass http://{upstream};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host {host};
{rewrite}
            proxy_buffering off;
            # unbuffered, nginx reads upstream into this one buffer (default a page: 4 KiB
            # reads held the chain to ~200 MiB/s for one stream)
            proxy_buffer_size 256k;
            proxy_buffers 4 256k;
            proxy_busy_buffers_size 256k;
            proxy_request_buffering off;
            proxy_max_temp_file_size 0;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
        }}
    }}
"""


class Nginx(ServerProcess):
    """One nginx (master + workers) in the foreground, stopped by pid. `servers`: (port, tls?,
    upstream port, origin the clients use: sent upstream as Host); each server logs one line per request (port, protocol, status, bytes) so
    what a client actually spoke can be counted."""

    def __init__(self, pki: Pki, workdir: str, servers: list):
        self.pki, self.servers = pki, servers
        self.dir = os.path.join(workdir, "nginx")
        self.proc: subprocess.Popen | None = None
        self._marks: dict = {}

    def start(self) -> "Nginx":
        os.makedirs(self.dir, exist_ok=True)
        ups = sorted({s[2] for s in self.servers})
        conf = NGINX_CONF.format(
            workers=2, dir=self.dir, cert=self.pki.cert, key=self.pki.key,
            upstreams="".join(NGINX_UPSTREAM.format(name=f"up{u}", port=u) for u in ups),
            servers="".join(NGINX_SERVER.format(port=p, tls=" ssl http2" if t else "", dir=self.dir,
                                                upstream=f"up{u}", host=origin,
                                                rewrite=NGINX_REWRITE if t else "")
                            for p, t, u, origin in self.servers))
        path = os.path.join(self.dir, "nginx.conf")
        with open(path, "w") as f:
            f.write(conf)
        binary = nginx_binary()
        test = subprocess.run([binary, "-t", "-q", "-p", self.dir, "-c", path], capture_output=True, text=True,
                              check=False)
        if test.returncode != 0:
            raise BenchError(f"nginx -t: {test.stderr.strip()[-600:]}")
        logf = open(os.path.join(self.dir, "nginx.out"), "wb")
        self.proc = subprocess.Popen([binary, "-p", self.dir, "-c", path], stdin=subprocess.DEVNULL,
                                     stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        logf.close()
        at_cleanup(self.stop)
        import socket
        deadline = time.monotonic() + 20
        for port, *_rest in self.servers:
            while True:
                if self.proc.poll() is not None:
                    raise BenchError(f"nginx exited ({self.proc.returncode}): {self._err_tail()}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise BenchError(f"nginx does not listen on 127.0.0.1:{port}: {self._err_tail()}")
                    time.sleep(0.05)
        v = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
        self.version = (v.stderr or v.stdout).strip()
        return self

    def _err_tail(self) -> str:
        for name in ("nginx-error.log", "nginx.out"):
            try:
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    tail = f.read()[-600:].strip()
                if tail:
                    return tail
            except OSError:
                pass
        return ""

    def _log(self, port: int) -> str:
        return os.path.join(self.dir, f"access-{port}.log")

    def reset_protocols(self, port: int) -> None:
        p = self._log(port)
        self._marks[port] = os.path.getsize(p) if os.path.exists(p) else 0

    def protocols(self, port: int) -> dict:
        """Requests per protocol on `port` since reset_protocols: {"HTTP/2.0": n, "HTTP/1.1": m}."""
        p = self._log(port)
        if not os.path.exists(p):
            return {}
        with open(p, "rb") as f:
            f.seek(self._marks.get(port, 0))
            data = f.read()
        counts: dict = {}
        for line in data.decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 2:
                counts[parts[1]] = counts.get(parts[1], 0) + 1
        return counts


class TlsLink:
    """--link with --tls: front linkproxy (raw: set-up, caps) → nginx (TLS) → back linkproxy
    (TTFB) → the server. Looks like a LinkProxy to the phases (url, reset_stats, stats):
    connections are the front proxy's (the clients' own), requests and bytes the back one's,
    plus how many requests nginx saw per HTTP version."""

    def __init__(self, front, back, nginx: Nginx, tls_port: int):
        self.front, self.back, self.nginx, self.tls_port = front, back, nginx, tls_port
        self.url = f"https://127.0.0.1:{front.port}"

    def reset_stats(self) -> None:
        self.front.reset_stats()
        self.back.reset_stats()
        self.nginx.reset_protocols(self.tls_port)

    def stats(self) -> dict:
        f, b = self.front.stats(), self.back.stats()
        out = dict(b)
        out["connections"] = f["connections"]
        out["closed"] = f["closed"]
        # the front proxy forwards TLS unframed: which connection carried a request is unknown
        out["connections_used"] = None
        protos = self.nginx.protocols(self.tls_port)
        out["http2"] = protos.get("HTTP/2.0", 0)
        out["http1"] = sum(v for k, v in protos.items() if k.startswith("HTTP/1"))
        return out


def start_tls_link(link_mod, profile: str, upstream_port: int, pki: Pki, workdir: str) -> TlsLink:
    """The chain for `profile`, in front of upstream_port (the server may start after it)."""
    params = dict(link_mod.PROFILES[profile])
    back_port, tls_port, front_port = free_port(), free_port(), free_port()
    nginx = Nginx(pki, workdir, [(tls_port, True, back_port, f"127.0.0.1:{front_port}")])
    back = link_mod.LinkProxy(upstream_port, ttfb_ms=params["ttfb_ms"], port=back_port,
                              log_path=os.path.join(workdir, "linkproxy-back.log"))
    front = link_mod.LinkProxy(tls_port, conn_mibps=params["conn_mibps"], total_mibps=params["total_mibps"],
                               setup_ms=params["setup_ms"], raw=True, port=front_port,
                               log_path=os.path.join(workdir, "linkproxy.log"))
    for p in (back, front):
        open(p.log_path, "wb").close()
        try:
            p.start()
        except RuntimeError as exc:
            raise BenchError(f"link proxy did not start: {exc}") from None
        at_cleanup(p.stop)
    nginx.start()
    log(f"TLS link '{profile}': {front.url.replace('http:', 'https:')} = linkproxy --raw (setup "
        f"{params['setup_ms']} ms, {params['conn_mibps']} MiB/s per connection, {params['total_mibps']} total) "
        f"-> nginx pid {nginx.pid} TLS :{tls_port} ({nginx.version}) -> linkproxy (TTFB {params['ttfb_ms']} ms) "
        f":{back.port} -> 127.0.0.1:{upstream_port}")
    return TlsLink(front, back, nginx, tls_port)


# --------------------------------------------------------------------------- what TLS costs
def curl_tls_args(pki: Pki, version: str) -> list:
    return ["--cacert", pki.ca, "--http1.1" if version == "1.1" else "--http2"]


def measure_tls_overhead(link_mod, upstream_port: int, path: str, size: int, pki: Pki, workdir: str,
                         runs: int = 3, streams: int = 16) -> dict:
    """The chain with no delays and no caps, plain http vs TLS (h1.1, h2), interleaved, medians
    of `runs`: one stream, `streams` ranged streams, a keep-alive 4 KiB GET p50. Plain goes
    through the same front proxy, nginx (a plain listener) and back proxy, so the difference is
    TLS alone; direct (curl to fake-gcs-server) is beside it."""
    from . import baselines
    back_port, tls_port, plain_port, ft_port, fp_port = (free_port() for _ in range(5))
    nginx = Nginx(pki, os.path.join(workdir, "overhead"), [(tls_port, True, back_port, f"127.0.0.1:{ft_port}"),
                                                          (plain_port, False, back_port, f"127.0.0.1:{fp_port}")])
    procs = []
    res: dict = {"runs": runs, "streams": streams, "size_mib": size / (1 << 20)}
    try:
        back = link_mod.LinkProxy(upstream_port, port=back_port, workdir=None).start()
        procs.append(back)
        front_tls = link_mod.LinkProxy(tls_port, raw=True, port=ft_port).start()
        procs.append(front_tls)
        front_plain = link_mod.LinkProxy(plain_port, raw=True, port=fp_port).start()
        procs.append(front_plain)
        nginx.start()
        variants = [("direct", f"http://127.0.0.1:{upstream_port}{path}", []),
                    ("plain", f"http://127.0.0.1:{front_plain.port}{path}", []),
                    ("tls_h1", f"https://127.0.0.1:{front_tls.port}{path}", curl_tls_args(pki, "1.1")),
                    ("tls_h2", f"https://127.0.0.1:{front_tls.port}{path}", curl_tls_args(pki, "2"))]
        samples: dict = {}
        for r in range(runs):
            for name, url, extra in variants:
                samples.setdefault(f"{name}_1_mibps", []).append(baselines.curl_single(url, size, extra))
                samples.setdefault(f"{name}_{streams}_mibps", []).append(
                    baselines.curl_parallel(url, size, streams, extra))
                samples.setdefault(f"{name}_get_p50_us", []).append(
                    baselines.curl_latency(url, size, 4242 + r, extra)[0])
    finally:
        nginx.stop()
        for p in procs:
            p.stop()
            p.remove_log()
    import statistics
    for k, v in samples.items():
        res[k] = statistics.median(v)
        res[k + "_all"] = [round(x, 1) for x in v]
    return res


def measure_loopback_tls_overhead(http_url: str, https_url: str, size: int, pki: Pki, runs: int = 3,
                                  streams: int = 8) -> dict:
    """Loopback --tls: the same fake-gcs-server over plain http and over its own TLS (h1.1, h2)."""
    from . import baselines
    import statistics
    variants = [("plain", http_url, []), ("tls_h1", https_url, curl_tls_args(pki, "1.1")),
                ("tls_h2", https_url, curl_tls_args(pki, "2"))]
    samples: dict = {}
    for r in range(runs):
        for name, url, extra in variants:
            samples.setdefault(f"{name}_1_mibps", []).append(baselines.curl_single(url, size, extra))
            samples.setdefault(f"{name}_{streams}_mibps", []).append(baselines.curl_parallel(url, size, streams, extra))
            samples.setdefault(f"{name}_get_p50_us", []).append(baselines.curl_latency(url, size, 4242 + r, extra)[0])
    res: dict = {"runs": runs, "streams": streams, "size_mib": size / (1 << 20)}
    for k, v in samples.items():
        res[k] = statistics.median(v)
        res[k + "_all"] = [round(x, 1) for x in v]
    return res


def overhead_line(over: dict) -> str:
    n = over.get("streams", 16)
    names = [("direct", "direct to fake-gcs-server"), ("plain", "plain http"), ("tls_h1", "TLS h1.1"),
             ("tls_h2", "TLS h2")]
    cells = []
    for k, label in names:
        if f"{k}_1_mibps" in over:
            cells.append(f"{label} {over[f'{k}_1_mibps']:.0f} / {over[f'{k}_{n}_mibps']:.0f} MiB/s / "
                         f"{over[f'{k}_get_p50_us']:.0f} µs")
    return (f"what TLS costs in this topology with no delays or caps (curl: 1 stream / {n} streams / 4 KiB GET "
            f"p50, median of {over.get('runs')}): " + "; ".join(cells))


# --------------------------------------------------------------------------- the walk over TLS
@contextlib.contextmanager
def https_walk(module, pki: Pki | None):
    """While inside, `module`'s http.client.HTTPConnection is an HTTPS connection that trusts
    `pki`'s CA (Tests/integration/scale_server.py's walk() names http.client.HTTPConnection;
    it is owned by the tests, so it is wrapped here, not changed). Does nothing without pki."""
    if pki is None:
        yield
        return
    ctx = pki.ssl_context()
    ctx.set_alpn_protocols(["http/1.1"])

    def https(host, port=None, timeout=None, **kw):
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx, **kw)

    saved = module.http
    module.http = types.SimpleNamespace(client=types.SimpleNamespace(HTTPConnection=https))
    try:
        yield
    finally:
        module.http = saved


def parse_http_versions(text: str) -> list:
    """--http-versions: '1.1,2' (default), '1.1', '2', or 'default' (storefs without the option)."""
    if text.strip() == "default":
        return ["default"]
    out = [v.strip() for v in text.split(",") if v.strip()]
    for v in out:
        if v not in HTTP_VERSIONS:
            raise ValueError(f"--http-versions: {v!r} is not one of 1.1, 2, default")
    return out

