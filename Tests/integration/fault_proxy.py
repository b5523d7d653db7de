"""A fault-injecting HTTP proxy for the storefs integration suite.

`FaultProxy(upstream)` listens on a free 127.0.0.1 port and forwards every request to
`upstream` (fake-gcs-server's endpoint, or `FirebaseStorageServer.endpoint` for the v0 REST
API) the way `storefs_testlib._ProxyHandler` does: keep-alive towards storefs, TCP_NODELAY,
one keep-alive upstream connection per client connection, and the upstream origin replaced
by the proxy's in JSON bodies (so `mediaLink`/`selfLink` lead back here). For each request
it may inject one fault instead.

TLS (issue 42): this proxy stays plain http on both sides. Its faults are about HTTP and TCP
(statuses, resets, stalls, torn bodies), which TLS would only wrap, and injecting them into
decrypted streams would need a TLS server per fault; the suite's TLS behaviour is tested in
test_tls.py instead. So `upstream` must be a plain origin (`emulator.http_endpoint`,
`FirebaseStorageServer.plain_endpoint`): an https one is refused. `aliases`: more origins
replaced by the proxy's in JSON bodies (the emulator's links name its https origin even when
asked on its plain port).

    p = FaultProxy(emulator.http_endpoint, aliases=[emulator.endpoint]).start()
    mount(..., endpoint=p.endpoint)
    p.add_rule(kind="media", name_prefix="dir/x", fault="status", status=503, count=2)
    p.random_faults(kinds=("media",), rate=0.10, seed=7,
                    faults=["reset_mid_body", {"fault": "status", "status": 429,
                                                "retry_after": 1, "weight": 2}])
    ... p.log, p.fault_counts, p.counts ...
    p.stop()          # also releases every held (blackholed, stalled, trickling) socket

Request kinds (`classify_any`): GCS JSON paths via `storefs_testlib.classify`, v0 paths via
`classify_v0` (`/v0/b/B/o?...` list, `/v0/b/B/o/NAME` metadata, `...?alt=media` media):
"list" (`prefix` = the prefix query parameter), "metadata", "media" (`name` = decoded object
name), or "other".

Choosing a fault, per request, in this order:
  1. scripted rules, first added first: `add_rule(kind=None|"media"|("list","metadata"),
     name_prefix=None, fault="status", count=None|N, match=None, **params) -> FaultRule`.
     `name_prefix` is matched against the object name (metadata/media) or against the
     `prefix` parameter (list); `match(req) -> bool` can narrow further; `count` = how many
     times the rule fires (None: forever); `seed` seeds the fault's own choices (which bits
     bitflip flips). `clear_rules()` drops rules (held sockets stay).
  2. seeded random plans, first added first: `random_faults(kinds=("media",), rate=0.1,
     seed=N, faults=[...], name_prefix=None, match=None) -> FaultPlan`. A spec is a fault
     name or a dict {"fault": name, "weight": w, **params}. The decision for a request is
     drawn from random.Random(seed, method, target, Range, n-th repetition of that request),
     so it does not depend on the order in which concurrent requests arrive. Only faults
     that apply to the request are candidates (`whole_for_range` needs a Range, listing
     faults need a list request). `clear_plans()` drops them.
A fault that does not apply to a request (e.g. `wrong_content_range` on a GET without
Range) leaves it honest; the log says so in `note`.

Faults and their parameters:
  status              answer `status` (default 503; 500/503/429...) with a JSON error body;
                      `retry_after` (seconds, or any string) adds a Retry-After header.
  reset_before_headers  read the request, then close with SO_LINGER 0 (RST), nothing sent.
  reset_mid_body      status + headers + part of the body, then RST. `fraction` (0.5) of the
                      body or `after_bytes`.
  stall_mid_body      like reset_mid_body, then sleep `seconds` (default 30), then close (FIN).
  truncate            headers with the full Content-Length, part of the body, close (FIN).
  whole_for_range     a ranged GET is fetched upstream without Range and answered 200 with
                      the whole object.
  wrong_content_range a 206 whose Content-Range start (and body) is shifted by `shift`
                      bytes (default 4096; -shift, +1 or -1 when that falls outside).
  shifted_body        the true status and headers (Content-Range included), but the body is
                      taken from offset + `shift` (default 1).
  bitflip             flip `flips` (default 1) random bits of the body; nothing else changes.
  trickle             the honest headers, then the body at `bytes_per_s` (default 2).
  blackhole           read the request and never answer; the socket is held until the
                      client closes it, `release()` or `stop()`.
  delay               sleep `seconds` (default 3), then forward honestly.
  items_not_list      (list) the honest page with "items" replaced by `value` (default a string).
  looping_token       (list) the first page (pageToken dropped upstream) with nextPageToken
                      always `token` (default "storefs-loop"), forever.
  huge_page           (list) the honest page plus one item whose metadata value (or name, with
                      `where="name"`) is `size` bytes (default 42 MiB): valid JSON of > 40 MB.
  endless_error_body  500 with a chunked JSON body that never ends (`chunk` bytes every
                      `interval` s, default 1024 / 0.05), until the client goes away.
Waits (stall, delay, trickle, blackhole, endless body) end early on `release()` and `stop()`.

Records: `log` (list of FaultRequest, one per request: kind, method, path, name, prefix,
query, range, fault, params, status, bytes_sent, note, and monotonic times `t_arrival`,
`t_answer` (first status line sent, or the fault acted), `t_done`); `requests(kind=None,
fault=None, name_prefix=None)`; `counts` (by kind, on arrival); `fault_counts` (by fault);
`inflight()` (requests being handled); `media_bytes`.

Other controls: `list_page_size = N` lowers `maxResults` of forwarded list requests (an
honest server may return short pages); `release()` wakes all waits; `reset()` clears rules, plans,
log and counters. `stop()` (may be called more than once) also shuts every client
connection down, so nothing is served after it; `cut()` is the same.
"""

from __future__ import annotations

import http.client
import io
import http.server
import json
import random
import re
import select
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from storefs_testlib import LoopbackServer, ProxyRequest, classify

__all__ = ["FaultProxy", "FaultRequest", "FaultRule", "FaultPlan", "FAULTS", "LIST_FAULTS",
           "classify_v0", "classify_any"]

MiB = 1 << 20

FAULTS = ("status", "reset_before_headers", "reset_mid_body", "stall_mid_body", "truncate",
          "whole_for_range", "wrong_content_range", "shifted_body", "bitflip", "trickle",
          "blackhole", "delay", "items_not_list", "looping_token", "huge_page",
          "endless_error_body")
LIST_FAULTS = ("items_not_list", "looping_token", "huge_page")
RANGE_FAULTS = ("whole_for_range", "wrong_content_range")

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailer", "trailers", "transfer-encoding", "upgrade"}
_V0_LIST_RE = re.compile(r"^/v0/b/([^/]+)/o/?$")
_V0_OBJECT_RE = re.compile(r"^/v0/b/([^/]+)/o/([^/]+)$")
_RANGE_RE = re.compile(r"^\s*bytes=(\d+)-(\d*)\s*$")
_CRANGE_RE = re.compile(r"^\s*bytes (\d+)-(\d+)/(\d+|\*)\s*$")


def classify_v0(method: str, target: str) -> ProxyRequest:
    """Firebase v0 request kinds: list, metadata, media (alt=media), other."""
    parts = urllib.parse.urlsplit(target)
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    m = _V0_OBJECT_RE.match(parts.path)
    if m:
        name = urllib.parse.unquote(m.group(2))
        kind = "media" if query.get("alt", [""])[0] == "media" else "metadata"
        return ProxyRequest(kind, method, target, name, None, query)
    if _V0_LIST_RE.match(parts.path):
        return ProxyRequest("list", method, target, None, query.get("prefix", [""])[0], query)
    return ProxyRequest("other", method, target, None, None, query)


def classify_any(method: str, target: str) -> ProxyRequest:
    if urllib.parse.urlsplit(target).path.startswith("/v0/"):
        return classify_v0(method, target)
    return classify(method, target)


@dataclass
class FaultRequest(ProxyRequest):
    seq: int = 0
    fault: str | None = None
    params: dict = field(default_factory=dict)
    note: str = ""
    bytes_sent: int = 0
    t_arrival: float = 0.0
    t_answer: float = 0.0
    t_done: float = 0.0


def _kinds(kind) -> tuple[str, ...] | None:
    if kind is None:
        return None
    return (kind,) if isinstance(kind, str) else tuple(kind)


def _name_matches(req: ProxyRequest, name_prefix: str | None) -> bool:
    if name_prefix is None:
        return True
    subject = (req.prefix or "") if req.kind == "list" else req.name
    return subject is not None and subject.startswith(name_prefix)


def applicable(fault: str, req: ProxyRequest) -> bool:
    if fault in LIST_FAULTS:
        return req.kind == "list"
    if fault in RANGE_FAULTS:
        return bool(req.range and _RANGE_RE.match(req.range))
    return True


@dataclass
class FaultRule:
    kinds: tuple[str, ...] | None
    name_prefix: str | None
    fault: str
    params: dict
    count: int | None
    match: Callable[[ProxyRequest], bool] | None = None
    seed: int = 0
    fired: int = 0

    def matches(self, req: ProxyRequest) -> bool:
        if self.count is not None and self.fired >= self.count:
            return False
        if self.kinds is not None and req.kind not in self.kinds:
            return False
        if not _name_matches(req, self.name_prefix):
            return False
        return self.match is None or bool(self.match(req))


@dataclass
class FaultPlan:
    kinds: tuple[str, ...] | None
    rate: float
    seed: int
    specs: list[tuple[str, dict, float]]     # (fault, params, weight)
    name_prefix: str | None = None
    match: Callable[[ProxyRequest], bool] | None = None

    def decide(self, req: ProxyRequest, occurrence: int) -> tuple[str, dict, random.Random] | None:
        if self.kinds is not None and req.kind not in self.kinds:
            return None
        if not _name_matches(req, self.name_prefix):
            return None
        if self.match is not None and not self.match(req):
            return None
        rng = random.Random(f"{self.seed}|{req.method} {req.path}|{req.range}|{occurrence}")
        if rng.random() >= self.rate:
            return None
        cands = [s for s in self.specs if applicable(s[0], req)]
        if not cands:
            return None
        pick = rng.uniform(0, sum(w for _, _, w in cands))
        for fault, params, weight in cands:
            pick -= weight
            if pick <= 0:
                return fault, dict(params), rng
        fault, params, _ = cands[-1]
        return fault, dict(params), rng


def _spec(s) -> tuple[str, dict, float]:
    if isinstance(s, str):
        fault, params, weight = s, {}, 1.0
    else:
        params = dict(s)
        fault = params.pop("fault")
        weight = float(params.pop("weight", 1.0))
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    return fault, params, weight


class _Gone(Exception):
    """The client connection is gone (or was reset by us): stop serving it."""


class FaultProxy(LoopbackServer):
    """See the module docstring."""

    thread_name = "fault-proxy"

    def __init__(self, upstream: str, aliases=()) -> None:
        self.upstream = upstream.rstrip("/")
        self.aliases = [a.rstrip("/") for a in aliases if a and a.rstrip("/") != self.upstream]
        up = urllib.parse.urlsplit(self.upstream)
        if up.scheme != "http":
            raise ValueError(f"FaultProxy forwards to plain http only, not {upstream!r}: use "
                             "emulator.http_endpoint / FirebaseStorageServer.plain_endpoint")
        self._up_host, self._up_port = up.hostname, up.port
        self.list_page_size: int | None = None
        self.rules: list[FaultRule] = []
        self.plans: list[FaultPlan] = []
        self.log: list[FaultRequest] = []
        self.counts: Counter[str] = Counter()
        self.fault_counts: Counter[str] = Counter()
        self.media_bytes = 0
        self._occ: Counter[tuple] = Counter()
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._inflight = 0
        self._wake = threading.Event()
        self._stopped = False

    def request_handler(self) -> type:
        return _FaultHandler

    # -------------------------------------------------------------- configuration
    def add_rule(self, kind=None, name_prefix: str | None = None, fault: str = "status",
                 count: int | None = None, match=None, seed: int = 0, **params) -> FaultRule:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        rule = FaultRule(_kinds(kind), name_prefix, fault, params, count, match, seed)
        with self._lock:
            self.rules.append(rule)
        return rule

    def random_faults(self, kinds=("media",), rate: float = 0.10, seed: int = 0,
                      faults=("status",), name_prefix: str | None = None, match=None) -> FaultPlan:
        plan = FaultPlan(_kinds(kinds), float(rate), seed, [_spec(s) for s in faults],
                         name_prefix, match)
        with self._lock:
            self.plans.append(plan)
        return plan

    def clear_rules(self) -> None:
        with self._lock:
            self.rules.clear()

    def clear_plans(self) -> None:
        with self._lock:
            self.plans.clear()

    def reset(self) -> None:
        with self._lock:
            self.rules.clear()
            self.plans.clear()
            self.log.clear()
            self.counts.clear()
            self.fault_counts.clear()
            self._occ.clear()
            self.media_bytes = 0

    # -------------------------------------------------------------- records
    def requests(self, kind: str | None = None, fault: str | None = None,
                 name_prefix: str | None = None) -> list[FaultRequest]:
        with self._lock:
            out = list(self.log)
        return [r for r in out if (kind is None or r.kind == kind)
                and (fault is None or r.fault == fault)
                and (name_prefix is None or _name_matches(r, name_prefix))]

    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.inflight() == 0:
                return True
            time.sleep(0.05)
        return self.inflight() == 0

    def summary(self) -> str:
        with self._lock:
            kinds = dict(self.counts)
            faults = dict(self.fault_counts)
        return f"requests by kind {kinds}; faults {faults}"

    # -------------------------------------------------------------- internals
    def _choose(self, req: FaultRequest) -> tuple[str, dict, random.Random] | None:
        with self._lock:
            key = (req.method, req.path, req.range)
            occ = self._occ[key]
            self._occ[key] += 1
            for rule in self.rules:
                if rule.matches(req):
                    if not applicable(rule.fault, req):
                        req.note = f"rule fault {rule.fault} does not apply"
                        continue
                    rule.fired += 1
                    rng = random.Random(f"rule{rule.seed}|{req.method} {req.path}|{req.range}|{occ}")
                    return rule.fault, dict(rule.params), rng
            plans = list(self.plans)
        for plan in plans:
            choice = plan.decide(req, occ)
            if choice is not None:
                return choice
        return None

    def _arrived(self, req: FaultRequest) -> None:
        with self._lock:
            req.seq = len(self.log)
            self.log.append(req)
            self.counts[req.kind] += 1
            self._inflight += 1

    def _applied(self, req: FaultRequest) -> None:
        with self._lock:
            self.fault_counts[req.fault] += 1

    def _done(self, req: FaultRequest) -> None:
        with self._lock:
            req.t_done = time.monotonic()
            self._inflight -= 1

    def _add_media_bytes(self, n: int) -> None:
        with self._lock:
            self.media_bytes += n

    def _track(self, sock: socket.socket, live: bool) -> None:
        with self._lock:
            (self._live.add if live else self._live.discard)(sock)

    def wait(self, seconds: float | None) -> bool:
        """Sleeps up to `seconds` (None: until woken); True when woken by release()/stop()."""
        with self._lock:
            ev = self._wake
        return ev.wait(seconds)

    # -------------------------------------------------------------- lifecycle
    def release(self) -> None:
        """Ends every wait in progress (blackholes close, stalls end, delays forward now)."""
        with self._lock:
            ev, self._wake = self._wake, (threading.Event() if not self._stopped else self._wake)
        ev.set()

    def stop(self) -> None:
        """The proxy goes away: no more listening, every wait ends, every client connection is
        shut down (unlike ForbiddingProxy.stop, keep-alive connections are not served on)."""
        with self._lock:
            self._stopped = True
        self._wake.set()
        super().stop()
        with self._lock:
            live = list(self._live)
        self.shutdown_sockets(live)
        self.wait_idle(3.0)

    def cut(self) -> None:
        """The server goes away at once (ForbiddingProxy.cut): the same as stop() here."""
        self.stop()


class _FaultHandler(http.server.BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.owner._track(self.connection, True)
        self._conn: http.client.HTTPConnection | None = None

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:   # the client reset the connection between requests
            self.close_connection = True

    def finish(self) -> None:
        self.owner._track(self.connection, False)
        try:
            super().finish()
        except OSError:
            pass
        self._drop_upstream()

    # -------------------------------------------------------------- upstream
    def _drop_upstream(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _fetch(self, target: str | None = None, headers: dict | None = None) -> http.client.HTTPResponse:
        """Sends this request (or `target`/`headers` instead) upstream; returns the response
        with its body unread."""
        target = target or self.path
        hdrs = dict(self._in_headers if headers is None else headers)
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.owner._up_host, self.owner._up_port,
                                                        timeout=60)
            try:
                self._conn.request(self.command, target, body=self._body, headers=hdrs)
                return self._conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
                    http.client.CannotSendRequest, http.client.ResponseNotReady):
                self._drop_upstream()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _finish_upstream(self, resp: http.client.HTTPResponse, complete: bool) -> None:
        """After a response: keep the connection when its body was read to the end."""
        if complete:
            resp.close()
        else:
            self._drop_upstream()

    def _read_all(self, resp: http.client.HTTPResponse) -> bytes:
        data = resp.read()
        resp.close()
        if resp.getheader("Content-Type", "").startswith("application/json"):
            for origin in (self.owner.upstream, *self.owner.aliases):
                data = data.replace(origin.encode(), self.owner.endpoint.encode())
        return data

    @staticmethod
    def _headers_of(resp: http.client.HTTPResponse, drop=()) -> list[tuple[str, str]]:
        skip = _HOP_BY_HOP | {"content-length"} | {d.lower() for d in drop}
        return [(k, v) for k, v in resp.getheaders() if k.lower() not in skip]

    # -------------------------------------------------------------- to storefs
    def _write(self, data: bytes) -> None:
        if not data:
            return
        try:
            self.wfile.write(data)
        except OSError as exc:
            raise _Gone() from exc
        self.req.bytes_sent += len(data)
        if self.req.kind == "media":
            self.owner._add_media_bytes(len(data))

    def _head(self, status: int, reason: str, headers, length: int | None) -> None:
        """Status line and headers; length None means chunked."""
        self.req.status = status
        self.req.t_answer = time.monotonic()
        lines = [f"HTTP/1.1 {status} {reason}\r\n"]
        for k, v in headers:
            lines.append(f"{k}: {v}\r\n")
        if length is None:
            lines.append("Transfer-Encoding: chunked\r\n")
        else:
            lines.append(f"Content-Length: {length}\r\n")
        lines.append("\r\n")
        try:
            self.wfile.write("".join(lines).encode("latin-1"))
        except OSError as exc:
            raise _Gone() from exc

    def _send(self, status: int, reason: str, headers, body: bytes) -> None:
        self._head(status, reason, headers, len(body))
        if self.command != "HEAD":
            self._write(body)

    def _rst(self) -> None:
        """Abortive close: RST instead of FIN."""
        sock = self.connection
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        try:
            sock.close()
            # makefile() objects keep the descriptor open; close it for real.
            for f in (self.rfile, self.wfile):
                try:
                    f.close()
                except OSError:
                    pass
        except OSError:
            pass
        # http.server flushes and closes these after the request: give it harmless ones.
        self.rfile, self.wfile = io.BytesIO(), io.BytesIO()
        self.close_connection = True
        raise _Gone()

    def _fin(self) -> None:
        try:
            self.wfile.flush()
        except OSError:
            pass
        try:
            self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.close_connection = True
        raise _Gone()

    def _client_gone(self, timeout: float) -> bool:
        """Waits up to `timeout` for the client to close its side; True if it did."""
        try:
            r, _, _ = select.select([self.connection], [], [], timeout)
            if not r:
                return False
            return self.connection.recv(65536) == b""
        except OSError:
            return True

    # -------------------------------------------------------------- dispatch
    def _serve(self) -> None:
        req = classify_any(self.command, self.path)
        now = time.monotonic()
        self.req = req = FaultRequest(**vars(req), t_arrival=now)
        req.range = self.headers.get("Range")
        length = int(self.headers.get("Content-Length") or 0)
        self._body = self.rfile.read(length) if length else None
        self._in_headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if req.kind == "list" and self.owner.list_page_size:
            self._limit_page_size()
        self.owner._arrived(req)
        try:
            if self.owner._stopped:
                req.note = "proxy stopped"
                self._rst()
            choice = self.owner._choose(req)
            if choice is None:
                self._honest()
                return
            fault, params, rng = choice
            req.fault, req.params = fault, params
            self.rng = rng
            self.owner._applied(req)
            getattr(self, "_f_" + fault)(**params)
        except _Gone:
            self.close_connection = True
        except (http.client.HTTPException, OSError) as exc:
            # upstream trouble: tell storefs so (a test's fault is never silently lost)
            req.note += f" upstream error {exc!r}"
            self.close_connection = True
            if req.status == 0:
                try:
                    self._send(502, "Bad Gateway", [("Content-Type", "text/plain")], b"bad gateway")
                except _Gone:
                    pass
        finally:
            self.owner._done(req)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _limit_page_size(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        want = self.owner.list_page_size
        out, seen = [], False
        for k, v in q:
            if k == "maxResults":
                seen = True
                v = str(min(int(v), want)) if v.isdigit() else str(want)
            out.append((k, v))
        if not seen:
            out.append(("maxResults", str(want)))
        self.path = urllib.parse.urlunsplit(parts._replace(
            query=urllib.parse.urlencode(out, quote_via=urllib.parse.quote, safe="")))

    # -------------------------------------------------------------- honest forwarding
    def _honest(self, resp: http.client.HTTPResponse | None = None, status: int | None = None,
                drop=()) -> None:
        resp = resp or self._fetch()
        no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        ctype = resp.getheader("Content-Type", "")
        headers = self._headers_of(resp, drop)
        st = status or resp.status
        if ctype.startswith("application/json") and not no_body:
            self._send(st, resp.reason, headers, self._read_all(resp))
            return
        if no_body:
            resp.read()
            resp.close()
            self._head(st, resp.reason, headers, int(resp.getheader("Content-Length") or 0))
            return
        cl = resp.getheader("Content-Length")
        self._head(st, resp.reason, headers, None if cl is None else int(cl))
        complete = False
        try:
            while True:
                chunk = resp.read1(256 * 1024)
                if not chunk:
                    complete = True
                    break
                self._write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if cl is None else chunk)
        finally:
            self._finish_upstream(resp, complete)
        if cl is None:
            self._write(b"0\r\n\r\n")

    # -------------------------------------------------------------- faults
    def _f_status(self, status: int = 503, retry_after=None, message: str | None = None) -> None:
        reasons = {429: ("rateLimitExceeded", "Too Many Requests"), 500: ("internalError", "Internal Server Error"),
                   502: ("backendError", "Bad Gateway"), 503: ("backendError", "Service Unavailable"),
                   504: ("backendError", "Gateway Timeout"), 408: ("requestTimeout", "Request Timeout")}
        reason, phrase = reasons.get(status, ("backendError", "Error"))
        msg = message or f"injected {status}"
        body = json.dumps({"error": {"code": status, "message": msg, "errors": [
            {"domain": "global", "reason": reason, "message": msg}]}}).encode()
        headers = [("Content-Type", "application/json; charset=UTF-8")]
        if retry_after is not None:
            headers.append(("Retry-After", str(retry_after)))
        self._send(status, phrase, headers, body)

    def _f_reset_before_headers(self) -> None:
        self.req.t_answer = time.monotonic()
        self._rst()

    def _partial(self, fraction: float, after_bytes: int | None):
        """Sends status, headers and part of the body; returns (resp, complete) where
        complete means the whole body went out (nothing was left to cut)."""
        resp = self._fetch()
        if self.command == "HEAD" or resp.status in (204, 304):
            self._honest(resp)
            self.req.note = "no body to cut"
            return None
        cl = resp.getheader("Content-Length")
        body_json = resp.getheader("Content-Type", "").startswith("application/json")
        if body_json or cl is None:
            data = self._read_all(resp)
            total = len(data)
            cut = after_bytes if after_bytes is not None else int(total * fraction)
            cut = max(0, min(cut, total - 1))
            self._head(resp.status, resp.reason, self._headers_of(resp), total)
            self._write(data[:cut])
            return None if total == 0 else True
        total = int(cl)
        cut = after_bytes if after_bytes is not None else int(total * fraction)
        cut = max(0, min(cut, total - 1))
        self._head(resp.status, resp.reason, self._headers_of(resp), total)
        sent = 0
        while sent < cut:
            chunk = resp.read1(min(256 * 1024, cut - sent))
            if not chunk:
                break
            self._write(chunk)
            sent += len(chunk)
        self._drop_upstream()
        if total == 0:
            self.req.note = "empty body: nothing to cut"
            return None
        return True

    def _f_reset_mid_body(self, fraction: float = 0.5, after_bytes: int | None = None) -> None:
        self._partial(fraction, after_bytes)
        self._rst()

    def _f_truncate(self, fraction: float = 0.5, after_bytes: int | None = None) -> None:
        self._partial(fraction, after_bytes)
        self._fin()

    def _f_stall_mid_body(self, seconds: float = 30.0, fraction: float = 0.5,
                          after_bytes: int | None = None) -> None:
        self._partial(fraction, after_bytes)
        try:
            self.wfile.flush()
        except OSError:
            raise _Gone()
        self._hold(seconds)
        self._fin()

    def _f_whole_for_range(self) -> None:
        headers = {k: v for k, v in self._in_headers.items() if k.lower() != "range"}
        resp = self._fetch(headers=headers)
        if resp.status == 200:
            self._honest(resp)
        else:
            self.req.note = f"upstream {resp.status} without Range"
            self._honest(resp)

    def _f_wrong_content_range(self, shift: int = 4096) -> None:
        m = _RANGE_RE.match(self.req.range or "")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) else None
        for start in (a + shift, a - shift, a + 1, a - 1):
            if start < 0 or start == a:
                continue
            end = "" if b is None else str(b + (start - a))
            headers = dict(self._in_headers)
            for k in list(headers):
                if k.lower() == "range":
                    del headers[k]
            headers["Range"] = f"bytes={start}-{end}"
            resp = self._fetch(headers=headers)
            if resp.status == 206:
                self.req.note = f"answered {resp.getheader('Content-Range')}"
                self._honest(resp)
                return
            resp.read()
            resp.close()
        self.req.note = "no shifted range was satisfiable; honest"
        self._honest()

    def _f_shifted_body(self, shift: int = 1) -> None:
        resp = self._fetch()
        if resp.status not in (200, 206):
            self._honest(resp)
            return
        headers = self._headers_of(resp)
        status, reason = resp.status, resp.reason
        true = self._read_all(resp)
        n = len(true)
        a = 0
        m = _CRANGE_RE.match(resp.getheader("Content-Range") or "")
        if m:
            a = int(m.group(1))
        fake = None
        for s in (shift, -shift):
            start = a + s
            if start < 0 or s == 0 or n == 0:
                continue
            h = {k: v for k, v in self._in_headers.items() if k.lower() != "range"}
            h["Range"] = f"bytes={start}-{start + n - 1}"
            r2 = self._fetch(headers=h)
            data = r2.read()
            r2.close()
            if r2.status == 206 and len(data) == n:
                fake = data
                break
        if fake is None and n > 1:
            k = shift % n or 1
            fake = true[k:] + true[:k]
        self.req.note = "body unchanged (too short to shift)" if fake is None or fake == true else ""
        self._send(status, reason, headers, fake if fake is not None else true)

    def _f_bitflip(self, flips: int = 1) -> None:
        resp = self._fetch()
        headers = self._headers_of(resp)
        status, reason = resp.status, resp.reason
        data = bytearray(self._read_all(resp))
        bits = []
        if data:
            for _ in range(flips):
                bit = self.rng.randrange(len(data) * 8)
                data[bit // 8] ^= 1 << (bit % 8)
                bits.append(bit)
        self.req.note = f"flipped bits {bits}" if bits else "empty body: nothing flipped"
        self._send(status, reason, headers, bytes(data))

    def _f_trickle(self, bytes_per_s: float = 2.0) -> None:
        resp = self._fetch()
        headers = self._headers_of(resp)
        data = self._read_all(resp)
        self._head(resp.status, resp.reason, headers, len(data))
        step = max(1, int(bytes_per_s / 10))
        pause = step / bytes_per_s
        for i in range(0, len(data), step):
            self._write(data[i:i + step])
            if self.owner.wait(pause) or self._client_gone(0):
                raise _Gone()
        self._fin()

    def _f_blackhole(self) -> None:
        self.req.t_answer = time.monotonic()
        while True:
            if self.owner.wait(0.2):
                break
            if self._client_gone(0):
                break
        self._fin()

    def _hold(self, seconds: float) -> None:
        """Waits `seconds`, or until the proxy is released; ends early if the client left."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.owner.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
                break
            if self._client_gone(0):
                raise _Gone()

    def _f_delay(self, seconds: float = 3.0) -> None:
        self._hold(seconds)
        self._honest()

    # -------------------------------------------------------------- listing faults
    def _json_page(self, target: str | None = None):
        resp = self._fetch(target=target)
        data = self._read_all(resp)
        if resp.status != 200:
            return resp, None, data
        return resp, json.loads(data), data

    def _send_json(self, resp, obj) -> None:
        body = json.dumps(obj).encode()
        self._send(200, "OK", self._headers_of(resp), body)

    def _f_items_not_list(self, value="items is not a list") -> None:
        resp, page, raw = self._json_page()
        if page is None:
            self._send(resp.status, resp.reason, self._headers_of(resp), raw)
            return
        page["items"] = value
        self._send_json(resp, page)

    def _f_looping_token(self, token: str = "storefs-loop") -> None:
        parts = urllib.parse.urlsplit(self.path)
        q = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
             if k != "pageToken"]
        target = urllib.parse.urlunsplit(parts._replace(
            query=urllib.parse.urlencode(q, quote_via=urllib.parse.quote, safe="")))
        resp, page, raw = self._json_page(target)
        if page is None:
            self._send(resp.status, resp.reason, self._headers_of(resp), raw)
            return
        page["nextPageToken"] = token
        self._send_json(resp, page)

    def _f_huge_page(self, size: int = 42 * MiB, where: str = "metadata") -> None:
        resp, page, raw = self._json_page()
        if page is None:
            self._send(resp.status, resp.reason, self._headers_of(resp), raw)
            return
        prefix = self.req.prefix or ""
        bucket = next((i.get("bucket") for i in page.get("items") or [] if isinstance(i, dict)), None)
        bucket = bucket or urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.split("/")[-2])
        if where == "name":
            item = {"name": prefix + "h" * size, "bucket": bucket}
        else:
            item = {"name": prefix + "huge-page-item", "bucket": bucket, "size": "1",
                    "generation": "1", "metageneration": "1", "contentType": "text/plain",
                    "updated": "2026-01-01T00:00:00.000Z", "timeCreated": "2026-01-01T00:00:00.000Z",
                    "metadata": {"pad": "x" * size}}
        items = page.get("items")
        page["items"] = (items if isinstance(items, list) else []) + [item]
        self._send_json(resp, page)

    def _f_endless_error_body(self, chunk: int = 1024, interval: float = 0.05) -> None:
        self._head(500, "Internal Server Error",
                   [("Content-Type", "application/json; charset=UTF-8")], None)
        first = b'{"error":{"code":500,"message":"'
        self._write(b"%x\r\n%s\r\n" % (len(first), first))
        filler = b"%x\r\n%s\r\n" % (chunk, b"e" * chunk)
        while True:
            self._write(filler)
            if self.owner.wait(interval) or self._client_gone(0):
                break
        self._fin()
