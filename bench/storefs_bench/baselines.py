"""The baselines no filesystem is involved in: curl against the server (or the link proxy),
and the local disk (bench/README.md, "What happens" 2).

- `curl-1`: one GET of the whole object; MiB/s = size / curl's %{time_total}.
- `curl-N`: N curl processes at once, each a ranged GET of 1/N; MiB/s = size / wall time.
  N = 8 on loopback; 16 through a modelled link, where it is the link's ceiling.
- one 4 KiB ranged GET: curl CLI, many URLs in one invocation (one reused connection).
- http.client keep-alive 4 KiB GETs (informational: adds ~80–150 µs of Python).
- the local copy of big.bin read with dd after drop_caches: the disk's speed.
- the direct listing walk of tree/ (Tests/integration/scale_server.py's `walk()`: delimited,
  sequential, one keep-alive connection, each page JSON-decoded): what `find` and `ls -lR` of
  the tree cost before any filesystem is involved, through the link with --link.

With --tls every one of these goes over the same TLS as the mounts (tls.py): curl with
`--cacert` and `--http1.1`, plus curl-N again with `--http2` (curlN_h2) and the 4 KiB GET over
h2 (get_p50_h2); http.client and the walk over HTTPS, trusting the run's CA only.
"""

from __future__ import annotations

import http.client
import random
import subprocess
import time

from . import MIB
from .data import TREE_DIRS, TREE_FILES_PER_DIR
from .host import BenchError, drop_caches, log
from .readers import run_dds
from .servers import scale_server_module
from .stats import percentile
from .tls import curl_tls_args, https_walk

LAT_GETS = 300
LAT_WARMUP = 20


def curl_single(url: str, size: int, extra: list = ()) -> float:
    """curl-1: MiB/s of one GET of the whole object, from curl's own %{time_total}.
    `extra`: more curl options (with --tls: --cacert and the HTTP version)."""
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "--max-time", "300", *extra,
                          "-w", "%{http_code} %{size_download} %{time_total}", url],
                         capture_output=True, text=True, check=False)
    code, got, secs = out.stdout.split()
    if code != "200" or int(got) != size:
        raise BenchError(f"curl single GET: HTTP {code}, {got} bytes")
    return size / MIB / float(secs)


def curl_parallel(url: str, size: int, n: int, extra: list = ()) -> float:
    """curl-N: n ranged GETs at once, one slice each; MiB/s = size / wall time."""
    part = size // n
    procs = []
    t0 = time.monotonic()
    for i in range(n):
        a = i * part
        b = size - 1 if i == n - 1 else a + part - 1
        procs.append(subprocess.Popen(
            ["curl", "-s", "-o", "/dev/null", "--max-time", "300", *extra, "-r", f"{a}-{b}",
             "-w", "%{http_code} %{size_download}", url],
            stdout=subprocess.PIPE, text=True))
    total = 0
    for p in procs:
        out, _ = p.communicate()
        code, got = out.split()
        if code != "206":
            raise BenchError(f"curl ranged GET: HTTP {code}")
        total += int(got)
    secs = time.monotonic() - t0
    if total != size:
        raise BenchError(f"curl parallel: got {total} bytes, want {size}")
    return size / MIB / secs


def curl_latency(url: str, size: int, seed: int, extra: list = ()) -> tuple:
    """p50/p99 µs of 4 KiB ranged GETs, one curl invocation, one reused connection."""
    rng = random.Random(seed)
    offs = [rng.randrange(0, size // 4096) * 4096 for _ in range(LAT_WARMUP + LAT_GETS)]
    argv = ["curl"]
    for i, off in enumerate(offs):
        if i:
            argv.append("--next")
        argv += ["-s", "-o", "/dev/null", "--max-time", "30", *extra, "-r", f"{off}-{off + 4095}",
                 "-w", "%{http_code} %{size_download} %{time_total} %{num_connects}\\n", url]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = out.stdout.split("\n")[:-1]
    if len(lines) != len(offs):
        raise BenchError(f"curl latency: {len(lines)} answers for {len(offs)} requests: {out.stderr[-300:]}")
    lat, connects = [], 0
    for line in lines[LAT_WARMUP:]:
        code, got, secs, nconn = line.split()
        if code != "206" or got != "4096":
            raise BenchError(f"curl latency: HTTP {code}, {got} bytes")
        lat.append(float(secs) * 1e6)
        connects += int(nconn)
    if connects:
        log(f"note: curl opened {connects} new connection(s) during the latency sample")
    return percentile(lat, 50), percentile(lat, 99)


def httpclient_latency(port: int, path: str, size: int, seed: int, pki=None) -> tuple:
    """Same as curl_latency but with python http.client keep-alive (informational); HTTPS
    trusting pki's CA with --tls."""
    rng = random.Random(seed)
    if pki is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=pki.ssl_context())
    lat = []
    try:
        for i in range(LAT_WARMUP + LAT_GETS):
            off = rng.randrange(0, size // 4096) * 4096
            t0 = time.perf_counter_ns()
            conn.request("GET", path, headers={"Range": f"bytes={off}-{off + 4095}"})
            r = conn.getresponse()
            body = r.read()
            t1 = time.perf_counter_ns()
            if r.status != 206 or len(body) != 4096:
                raise BenchError(f"http.client ranged GET: HTTP {r.status}, {len(body)} bytes")
            if i >= LAT_WARMUP:
                lat.append((t1 - t0) / 1000.0)
    finally:
        conn.close()
    return percentile(lat, 50), percentile(lat, 99)


def local_disk_mibs(path: str) -> float:
    """dd of the local copy after drop_caches: what the cache disk reads at (a warm re-read's ceiling)."""
    drop_caches()
    [(got, secs)], _ = run_dds([["dd", f"if={path}", "of=/dev/null", "bs=1M"]], None)
    return got / MIB / secs


def listing_walk(endpoint: str, bucket: str, pki=None) -> float:
    """Seconds of the direct listing walk of tree/, its count checked against the tree's
    (over HTTPS with --tls: tls.https_walk)."""
    mod = scale_server_module()
    with https_walk(mod, pki):
        w = mod.walk(endpoint, bucket, prefix="tree/", delimited=True)
    want = TREE_DIRS * TREE_FILES_PER_DIR
    if w["objects"] != want:
        raise BenchError(f"listing walk of tree/: {w['objects']} objects, want {want}")
    return w["seconds"]


def new_baselines(streams: int, tls: bool = False) -> dict:
    """Per-run lists of every baseline; `curl{streams}` holds the N-stream throughput. With
    --tls these are over TLS with HTTP/1.1, and the `_h2` ones the same with HTTP/2."""
    base = {"curl1": [], f"curl{streams}": [], "get_p50": [], "get_p99": [], "hc_p50": [], "hc_p99": [],
            "local_cold": [], "walk": []}
    if tls:
        base.update({f"curl{streams}_h2": [], "get_p50_h2": [], "get_p99_h2": []})
    return base


def measure_baselines(base: dict, url: str, port: int, path: str, size: int, local_big: str,
                      streams: int, seed: int, endpoint: str, bucket: str, pki=None) -> None:
    """One run of every baseline, appended to `base` (see new_baselines); `endpoint` is the
    server's, or the link proxy's with --link. `pki`: --tls (tls.Pki): everything over TLS."""
    drop_caches()
    h1 = curl_tls_args(pki, "1.1") if pki else []
    base["curl1"].append(curl_single(url, size, h1))
    base[f"curl{streams}"].append(curl_parallel(url, size, streams, h1))
    p50, p99 = curl_latency(url, size, seed + 200, h1)
    base["get_p50"].append(p50)
    base["get_p99"].append(p99)
    if pki:
        h2 = curl_tls_args(pki, "2")
        base[f"curl{streams}_h2"].append(curl_parallel(url, size, streams, h2))
        p50h2, p99h2 = curl_latency(url, size, seed + 200, h2)
        base["get_p50_h2"].append(p50h2)
        base["get_p99_h2"].append(p99h2)
    base["local_cold"].append(local_disk_mibs(local_big))
    h50, h99 = httpclient_latency(port, path, size, seed + 300, pki)
    base["hc_p50"].append(h50)
    base["hc_p99"].append(h99)
    base["walk"].append(listing_walk(endpoint, bucket, pki))
    log(f"  curl 1 stream {base['curl1'][-1]:.0f} MiB/s, {streams} streams {base[f'curl{streams}'][-1]:.0f} MiB/s, "
        f"4K GET p50/p99 {p50:.0f}/{p99:.0f} µs (curl), {h50:.0f}/{h99:.0f} µs (http.client), "
        f"listing walk of tree/ {base['walk'][-1]:.3f} s")
    if pki:
        log(f"  over h2: {streams} streams {base[f'curl{streams}_h2'][-1]:.0f} MiB/s, "
            f"4K GET p50/p99 {base['get_p50_h2'][-1]:.0f}/{base['get_p99_h2'][-1]:.0f} µs (curl --http2)")
