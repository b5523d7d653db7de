"""A Firebase Storage v0 REST server on a loopback port, backed by fake-gcs-server.

The Firebase emulator cannot be installed here, so this speaks protocol.md §2 (with the
emulator behaviours of §7 where the two differ and production is unknown) and keeps the
objects in the session's fake-gcs-server (`GCSEmulator`), through its JSON API:

    GET /v0/b/{bucket}/o?prefix=&delimiter=/&pageToken=&maxResults=     list (§2.4, §7.10)
    GET /v0/b/{bucket}/o/{name as ONE percent-encoded segment}          metadata (§2.2)
    GET /v0/b/{bucket}/o/{name}?alt=media[&token=T]                     media (§2.3)

- Listing: items carry only name+bucket; invalid names (an empty segment once one leading
  `/` is dropped, the placeholder equal to the prefix) are dropped after the page is cut, so
  pages may be short; a non-empty prefix not ending in a single `/` is 400; page size
  min(maxResults or 1000, 1000, `max_page_size`); `nextPageToken` is the next item's name and
  a token naming no item restarts from the beginning; every page repeats all prefixes;
  `prefixes` and `items` are always present.
- Metadata: v0 JSON (numbers as decimal strings, timestamps with 3 fraction digits, crc32c
  as a decimal uint32 like the emulator unless `crc32c_format = "base64"`, `contentEncoding`
  "identity" when unset, `downloadTokens`, `metadata` without the token key).
- Reads can write (§2.2, §7.5): a metadata or media GET of an object without a download
  token stores a new UUID in its GCS custom metadata `firebaseStorageDownloadTokens`; v0 then
  shows `metageneration` + 1 and `updated` = now; `generation` is unchanged. (fake-gcs-server
  does not bump metageneration on PATCH, so the bumps are kept here, per generation.)
- Media: Range and Accept-Encoding passed through (206 + Content-Range; an unsatisfiable range
  is ignored, 200 whole body, as in the emulator §7.7), `x-goog-generation`,
  `x-goog-metadatageneration` (sic, §7.8); `token=` matching a download token skips the rules.
- Auth (§3.1): `Firebase <ID token>` verified by the AuthServer (signature, exp) -> uid;
  `Bearer <OAuth token the AuthServer issued>` -> admin (skips rules); nothing -> auth null;
  anything else or invalid/expired -> 401. `emulator_mode = True` accepts what the real
  emulator does instead: `Bearer owner` / `Firebase owner` as admin, unverified JWTs.
- Rules: `rules` is a list of (prefix, rule), first prefix match wins, default deny; rule is
  "public", "auth" (any signed-in user), "deny", a collection of uids, or a callable
  (path, Principal|None) -> bool. Checked before existence (§7.1): 403 JSON, then 404 `Not Found`.
- Speed: resources read from fake-gcs-server (by a GET, or in a listing's pages) are kept
  while `GCSEmulator.changes` stays, so a v0 request costs the emulator nothing more once
  its object was listed or read (`upstream_counts`: requests made to it, by method).
- Test hooks: `fail_next(n, status, kinds)`, `fail_always(status)`, `clear_faults()`,
  `metadata_delay`/`media_delay`, `empty_first_page`, `create_tokens`, `counts` by kind
  (list/metadata/media/other + `status:NNN`), `max_inflight` by kind, `log` of V0Request
  (method, target with any `token=` value redacted, kind, name/prefix, auth kind, uid,
  ID-token serial, status; never a credential).
"""

from __future__ import annotations

import base64
import datetime as _dt
import http.client
import http.server
import json
import re
import socket
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass

from storefs_testlib import LoopbackServer

from gcs_emulator import GCSEmulator, quote_name

TOKENS_KEY = "firebaseStorageDownloadTokens"
DEFAULT_PAGE = 1000
BAD_PREFIX_MESSAGE = "The prefix parameter is required to be empty or ends with a single / character."

_LIST_RE = re.compile(r"^/v0/b/([^/]+)/o/?$")
_OBJECT_RE = re.compile(r"^/v0/b/([^/]+)/o/([^/]+)$")


def v0_url(endpoint: str, bucket: str, name: str, token: str) -> str:
    """The download URL storefs must produce for protocol=firebase (§2.5, brief contract)."""
    return f"{endpoint}/v0/b/{quote_name(bucket)}/o/{quote_name(name)}?alt=media&token={token}"


def ms_timestamp(text: str) -> str:
    """RFC 3339 with 0-9 fraction digits -> UTC with exactly 3 digits (truncated), `Z`."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)", text)
    if not m:
        raise ValueError(f"unexpected timestamp {text!r}")
    base = _dt.datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
    base = base.astimezone(_dt.timezone.utc)
    ms = (m.group(2) or "0").ljust(3, "0")[:3]
    return base.strftime("%Y-%m-%dT%H:%M:%S") + f".{ms}Z"


def now_timestamp() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def valid_v0_name(name: str) -> bool:
    """No empty segment once one leading '/' is dropped (§2.4)."""
    if name.startswith("/"):
        name = name[1:]
    return name != "" and all(seg != "" for seg in name.split("/"))


@dataclass
class Principal:
    kind: str              # firebase | admin
    uid: str | None = None


@dataclass
class V0Request:
    method: str
    target: str            # raw request target, any token= value replaced by <redacted>
    kind: str              # list | metadata | media | root | write | other
    bucket: str | None = None
    name: str | None = None
    prefix: str | None = None
    page_token: str | None = None
    max_results: str | None = None
    range: str | None = None
    auth: str = "none"     # none | firebase | bearer | owner | invalid
    uid: str | None = None
    serial: int | None = None   # the ID token's storefs_serial claim
    download_token: bool = False
    status: int = 0
    reason: str = ""       # why 401/403/400, for failure messages


class _Fault:
    def __init__(self, remaining: float, status: int, kinds, retry_after: str | None) -> None:
        self.remaining, self.status, self.kinds, self.retry_after = remaining, status, kinds, retry_after


class FirebaseStorageServer(LoopbackServer):
    """See the module doc. `fb = FirebaseStorageServer(emulator, auth); fb.start(); fb.endpoint`.

    TLS (issue 42): `endpoint` is https (the session certificate; `tls=False` for plain http,
    see LoopbackServer); `plain_endpoint`/`host` is a second, plain-http listener with the same
    behaviour, because FIREBASE_STORAGE_EMULATOR_HOST=host:port means http (as the real
    emulator). Upstream it talks to the emulator's plain port (inside the test).
    """

    default_tls = True
    also_plain = True

    def __init__(self, emulator: GCSEmulator, auth=None, *, tls=None) -> None:
        self.tls = tls
        self.emulator = emulator
        self.auth = auth                       # auth_fixture.AuthServer, or None
        self.rules: list[tuple[str, object]] = [("", "public")]
        self.emulator_mode = False
        self.create_tokens = True
        self.crc32c_format = "decimal"         # emulator; "base64" like GCS
        self.max_page_size = DEFAULT_PAGE
        self.empty_first_page = False
        self.unsatisfiable_range = "ignore"    # emulator; "416" like GCS
        self.metadata_delay = 0.0
        self.media_delay = 0.0
        self.counts: Counter[str] = Counter()
        self.started: Counter[str] = Counter()
        self.inflight: Counter[str] = Counter()
        self.max_inflight: Counter[str] = Counter()
        self.log: list[V0Request] = []
        self.media_bytes = 0
        self._faults: list[_Fault] = []
        self._bumps: dict[tuple[str, str, str], tuple[int, str]] = {}
        self._created: dict[tuple[str, str, str], str] = {}   # token made here, per generation
        self._object_locks: dict[tuple[str, str], threading.Lock] = {}
        # GCS resources read from fake-gcs-server (None: no such object), good while the
        # emulator's change count is `_resources_seen` (see `_known`).
        self._resources: dict[tuple[str, str], dict | None] = {}
        self._resources_seen = -1
        self.upstream_counts: Counter[str] = Counter()   # requests to fake-gcs-server, by method
        self._lock = threading.Lock()
        self._local = threading.local()
        up = urllib.parse.urlsplit(emulator.http_endpoint or emulator.endpoint)
        self._up = (up.hostname, up.port)

    # -------------------------------------------------------------- lifecycle
    thread_name = "v0-fixture"

    def request_handler(self) -> type:
        return _V0Handler

    @property
    def host(self) -> str:
        """host:port of the plain listener, the FIREBASE_STORAGE_EMULATOR_HOST form (http)."""
        return f"127.0.0.1:{self.plain_port}"

    # -------------------------------------------------------------- test hooks
    def set_rules(self, rules: list[tuple[str, object]]) -> None:
        with self._lock:
            self.rules = list(rules)

    def fail_next(self, n: int, status: int = 429, kinds=("list", "metadata", "media"),
                  retry_after: str | None = None) -> None:
        with self._lock:
            self._faults.append(_Fault(n, status, tuple(kinds), retry_after))

    def fail_always(self, status: int = 429, kinds=("list", "metadata", "media"),
                    retry_after: str | None = None) -> None:
        with self._lock:
            self._faults.append(_Fault(float("inf"), status, tuple(kinds), retry_after))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.started.clear()
            self.max_inflight.clear()
            self.log.clear()
            self.media_bytes = 0
            self.upstream_counts.clear()

    def requests(self, kind: str | None = None) -> list[V0Request]:
        with self._lock:
            return [r for r in self.log if kind is None or r.kind == kind]

    def settle(self, quiet: float = 0.5, timeout: float = 15.0) -> bool:
        """Waits until nothing is in flight and nothing arrived for `quiet` seconds."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            with self._lock:
                now = (sum(self.started.values()), sum(self.inflight.values()))
            if now != last:
                last, since = now, time.monotonic()
            elif now[1] == 0 and time.monotonic() - since >= quiet:
                return True
            time.sleep(0.05)
        return False

    def v0_metadata(self, bucket: str, name: str) -> dict | None:
        """What a v0 metadata GET would answer now, without creating a token or logging."""
        res = self._gcs_object(bucket, name)
        return None if res is None else self._to_v0(res)

    # -------------------------------------------------------------- rules and auth
    def allowed(self, path: str, principal: Principal | None) -> bool:
        if principal is not None and principal.kind == "admin":
            return True
        with self._lock:
            rules = list(self.rules)
        for prefix, rule in rules:
            if not path.startswith(prefix):
                continue
            if callable(rule):
                return bool(rule(path, principal))
            if rule == "public":
                return True
            if rule == "auth":
                return principal is not None
            if rule == "deny":
                return False
            if isinstance(rule, (set, frozenset, list, tuple)):
                return principal is not None and principal.uid in rule
            raise ValueError(f"unknown rule {rule!r} for prefix {prefix!r}")
        return False

    def authenticate(self, header: str | None, req: V0Request) -> Principal | None:
        """The caller, None for no header; raises PermissionError(reason) for a 401."""
        if not header:
            return None
        scheme, _, cred = header.strip().partition(" ")
        cred = cred.strip()
        scheme_l = scheme.lower()
        if self.emulator_mode:
            if cred == "owner":
                req.auth = "owner"
                return Principal("admin")
            claims = _decode_unverified(cred)
            if claims is None:
                req.auth = "invalid"
                raise PermissionError("emulator mode: token is not a JWT")
            req.auth = scheme_l if scheme_l in ("firebase", "bearer") else "invalid"
            req.uid = claims.get("user_id") or claims.get("sub")
            return Principal("firebase", req.uid)
        if scheme_l == "firebase":
            req.auth = "firebase"
            if self.auth is None:
                raise PermissionError("no AuthServer to verify ID tokens")
            try:
                claims = self.auth.verify_id_token(cred)
            except Exception as exc:  # AuthError
                req.auth = "invalid"
                raise PermissionError(f"Firebase token rejected: {exc}") from None
            req.uid, req.serial = claims.get("user_id"), claims.get("storefs_serial")
            return Principal("firebase", req.uid)
        if scheme_l == "bearer":
            req.auth = "bearer"
            subject = self.auth.access_token_subject(cred) if self.auth is not None else None
            if subject is None:
                req.auth = "invalid"
                raise PermissionError("Bearer token is not a valid OAuth access token")
            req.uid = subject
            return Principal("admin", subject)
        req.auth = "invalid"
        raise PermissionError(f"unsupported Authorization scheme {scheme!r}")

    def take_fault(self, kind: str) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if kind in f.kinds and f.remaining > 0:
                    f.remaining -= 1
                    return f
        return None

    # -------------------------------------------------------------- upstream (fake-gcs)
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(*self._up, timeout=60)
            self._local.conn = conn
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _upstream(self, method: str, path: str, body: bytes | None = None,
                  headers: dict[str, str] | None = None, stream: bool = False):
        """(status, headers, body or the open response when stream)."""
        with self._lock:
            self.upstream_counts[method] += 1
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request(method, path, body=body, headers=headers or {})
                resp = conn.getresponse()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
                    http.client.CannotSendRequest, http.client.ResponseNotReady):
                self._drop_conn()
                if attempt:
                    raise
        if stream:
            return resp.status, resp, None
        data = resp.read()
        if resp.will_close:
            self._drop_conn()
        return resp.status, resp, data

    # What fake-gcs-server said about objects is kept until the bucket changes: it spends
    # 2.5 ms of CPU on a metadata GET here (6 on a PATCH), and asked once per v0 request it set
    # the pace of `ls -l` over v0 (issue 49, item 6: 2,500 names took 17.6 s, as long with the
    # storefs of late November as with today's). A listing's pages hold the same resources a
    # GET gives, so the metadata GETs that follow a listing are answered from them. Valid while
    # `emulator.changes` has not moved since they were asked for (every upload and delete
    # through GCSEmulator moves it once done; a test writing by other means calls
    # `emulator.note_change()`); this server's own token PATCH updates its entry.
    _MAX_RESOURCES = 100_000

    def _known(self, key: tuple[str, str]) -> tuple[int, bool, dict | None]:
        """(the emulator's change count now, whether `key` is known at that count, its resource)."""
        with self._lock:
            seen = self.emulator.changes
            if seen != self._resources_seen:
                self._resources.clear()
                self._resources_seen = seen
            return seen, key in self._resources, self._resources.get(key)

    def _remember(self, seen: int, resources, replace: bool = True) -> None:
        """Keeps (key, resource) pairs read since change count `seen`, unless it has moved.
        A listing's (`replace=False`) adds only what is not known: its page may have been read
        before this server's own token PATCH of an object, whose answer is newer."""
        with self._lock:
            if seen != self.emulator.changes or seen != self._resources_seen:
                return
            if len(self._resources) > self._MAX_RESOURCES:
                self._resources.clear()
            for key, res in resources:
                if replace or key not in self._resources:
                    self._resources[key] = res

    def _gcs_object(self, bucket: str, name: str) -> dict | None:
        seen, known, res = self._known((bucket, name))
        if known:
            return res
        # Under the object's lock, as its token PATCH: the one that lands last is the newer.
        with self._object_lock(bucket, name):
            status, _, data = self._upstream(
                "GET", f"/storage/v1/b/{quote_name(bucket)}/o/{quote_name(name)}")
            if status == 404:
                self._remember(seen, [((bucket, name), None)])
                return None
            if status != 200:
                raise RuntimeError(f"fake-gcs metadata {bucket}/{name}: HTTP {status} {data[:200]!r}")
            res = json.loads(data)
            self._remember(seen, [((bucket, name), res)])
            return res

    def _gcs_list(self, bucket: str, prefix: str, delimiter: str) -> tuple[list[str], list[str]]:
        items: list[str] = []
        prefixes: list[str] = []
        token = None
        seen = self._known((bucket, ""))[0]
        while True:
            q = {"prefix": prefix, "delimiter": delimiter}
            if token:
                q["pageToken"] = token
            query = urllib.parse.urlencode(q, quote_via=lambda s, *a: quote_name(s))
            status, _, data = self._upstream("GET", f"/storage/v1/b/{quote_name(bucket)}/o?{query}")
            if status == 404:            # the emulator creates buckets on demand (§7.11)
                return [], []
            if status != 200:
                raise RuntimeError(f"fake-gcs list {bucket}: HTTP {status} {data[:200]!r}")
            page = json.loads(data)
            self._remember(seen, [((bucket, i["name"]), i) for i in page.get("items", [])], replace=False)
            items += [i["name"] for i in page.get("items", [])]
            prefixes += [p for p in page.get("prefixes", []) if p not in prefixes]
            token = page.get("nextPageToken")
            if not token:
                return items, prefixes

    def _object_lock(self, bucket: str, name: str) -> threading.Lock:
        with self._lock:
            return self._object_locks.setdefault((bucket, name), threading.Lock())

    def ensure_token(self, bucket: str, res: dict) -> dict:
        """Token creation on read (§2.2, §7.5); returns the GCS resource with the token.

        One PATCH per (object, generation); concurrent readers of the same token-less object
        share the one token (the first creates it under a per-object lock).
        """
        if not self.create_tokens or (res.get("metadata") or {}).get(TOKENS_KEY):
            return res
        name = res["name"]
        key = (bucket, name, str(res["generation"]))
        with self._object_lock(bucket, name):
            with self._lock:
                token = self._created.get(key)
            if token is None:
                token = str(uuid.uuid4())
                seen = self._known((bucket, name))[0]
                status, _, data = self._upstream(
                    "PATCH", f"/storage/v1/b/{quote_name(bucket)}/o/{quote_name(name)}",
                    json.dumps({"metadata": {TOKENS_KEY: token}}).encode(),
                    {"Content-Type": "application/json"})
                if status != 200:
                    raise RuntimeError(f"fake-gcs PATCH {bucket}/{name}: HTTP {status} {data[:200]!r}")
                # fake-gcs-server answers a PATCH with a partial resource: the one read, with the token
                patched = dict(res, metadata={**(res.get("metadata") or {}), TOKENS_KEY: token})
                self._remember(seen, [((bucket, name), patched)])
                with self._lock:
                    self._created[key] = token
                    n, _ = self._bumps.get(key, (0, ""))
                    self._bumps[key] = (n + 1, now_timestamp())
                    self.counts["tokens_created"] += 1
        out = dict(res)
        out["metadata"] = {**(res.get("metadata") or {}), TOKENS_KEY: token}
        return out

    def _to_v0(self, res: dict) -> dict:
        bucket, name, gen = res["bucket"], res["name"], str(res["generation"])
        with self._lock:
            bump, updated = self._bumps.get((bucket, name, gen), (0, ""))
        custom = dict(res.get("metadata") or {})
        tokens = custom.pop(TOKENS_KEY, "")
        out = {
            "name": name,
            "bucket": bucket,
            "generation": gen,
            "metageneration": str(int(res.get("metageneration", "1")) + bump),
            "contentType": res.get("contentType") or "application/octet-stream",
            "timeCreated": ms_timestamp(res["timeCreated"]),
            "updated": updated or ms_timestamp(res["updated"]),
            "storageClass": res.get("storageClass", "STANDARD"),
            "size": str(int(res["size"])),
            "contentEncoding": res.get("contentEncoding") or "identity",
            "crc32c": res.get("crc32c", ""),
            "etag": res.get("etag", ""),
            "downloadTokens": tokens,
        }
        if self.crc32c_format == "decimal" and out["crc32c"]:
            out["crc32c"] = str(int.from_bytes(base64.b64decode(out["crc32c"]), "big"))
        for k in ("md5Hash", "cacheControl", "contentDisposition", "contentLanguage"):
            if res.get(k):
                out[k] = res[k]
        if custom:
            out["metadata"] = custom
        if not tokens:
            del out["downloadTokens"]
        return out

    def _track(self, kind: str, delta: int) -> None:
        with self._lock:
            if delta > 0:
                self.started[kind] += 1
            self.inflight[kind] += delta
            if self.inflight[kind] > self.max_inflight[kind]:
                self.max_inflight[kind] = self.inflight[kind]

    def _record(self, req: V0Request) -> None:
        with self._lock:
            self.counts[req.kind] += 1
            self.counts[f"status:{req.status}"] += 1
            self.log.append(req)


def _decode_unverified(token: str) -> dict | None:
    parts = token.split(".")
    if len(parts) < 2:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except Exception:  # noqa: BLE001
        return None
    return claims if isinstance(claims, dict) else None


_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-authenticate", "proxy-authorization"}


class _V0Handler(http.server.BaseHTTPRequestHandler):
    owner: FirebaseStorageServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body leave in separate writes: without this, Nagle + delayed ACK stall
        # every keep-alive response by ~40 ms and the fixture, not storefs, sets the pace.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -------------------------------------------------------------- responses
    def _send(self, status: int, body, content_type: str = "application/json; charset=utf-8",
              extra: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else (
            body.encode() if isinstance(body, str) else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self._release()
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, message: str, extra: dict[str, str] | None = None) -> None:
        self._send(status, {"error": {"code": status, "message": message}}, extra=extra)

    # -------------------------------------------------------------- dispatch
    def _classify(self) -> tuple[V0Request, dict[str, str]]:
        parts = urllib.parse.urlsplit(self.path)
        # '+' in a query is a space for the backend (§1.3); parse_qs does exactly that.
        query = {k: v[0] for k, v in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items()}
        target = re.sub(r"([?&]token=)[^&]*", r"\1<redacted>", self.path)
        req = V0Request(self.command, target, "other", range=self.headers.get("Range"),
                        download_token="token" in query)
        if self.command not in ("GET", "HEAD"):
            req.kind = "write"
            return req, query
        if parts.path in ("/v0", "/v0/"):
            req.kind = "root"
            return req, query
        m = _LIST_RE.match(parts.path)
        if m:
            req.kind, req.bucket = "list", urllib.parse.unquote(m.group(1))
            req.prefix = query.get("prefix", "")
            req.page_token, req.max_results = query.get("pageToken"), query.get("maxResults")
            return req, query
        m = _OBJECT_RE.match(parts.path)
        if m:
            req.bucket = urllib.parse.unquote(m.group(1))
            req.name = urllib.parse.unquote(m.group(2))   # path: '+' stays '+'
            req.kind = "media" if query.get("alt") == "media" else "metadata"
        return req, query

    def _serve(self) -> None:
        fb = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        req, query = self._classify()
        fb._track(req.kind, +1)
        self._inflight_kind = req.kind
        try:
            self._answer(req, query)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True      # storefs went away mid-answer (unmount, kill)
        except Exception as exc:  # noqa: BLE001 - a fixture bug must show, not hang storefs
            req.status, req.reason = 500, f"fixture error: {exc!r}"
            self.close_connection = True
            try:
                self._error(500, f"fixture error: {exc!r}")
            except OSError:
                pass
        finally:
            self._release()
            fb._record(req)

    def _release(self) -> None:
        """Ends this request's in-flight time (once): before its last bytes go out, so the
        client's next request never overlaps it in `max_inflight`."""
        kind, self._inflight_kind = getattr(self, "_inflight_kind", None), None
        if kind is not None:
            self.owner._track(kind, -1)

    def _answer(self, req: V0Request, query: dict[str, str]) -> None:
        fb = self.owner
        if req.kind == "write":
            req.status = 405
            return self._error(405, "storefs fixture: read-only server")
        if req.kind == "root":
            if fb.emulator_mode:
                req.status = 200
                return self._send(200, {"emulator": "storage"})
            req.status = 404
            return self._send(404, "Not Found", "text/plain; charset=utf-8")
        if req.kind == "other":
            req.status = 404
            return self._send(404, "Not Found", "text/plain; charset=utf-8")
        try:                 # parsed first so that faulted requests are logged with it too
            principal, auth_error = fb.authenticate(self.headers.get("Authorization"), req), None
        except PermissionError as exc:
            principal, auth_error = None, exc
        fault = fb.take_fault(req.kind)
        if fault is not None:
            req.status, req.reason = fault.status, "injected fault"
            extra = {"Retry-After": fault.retry_after} if fault.retry_after else None
            return self._error(fault.status, f"injected {fault.status} (test fault)", extra)
        if auth_error is not None:
            req.status, req.reason = 401, str(auth_error)
            return self._error(401, "Unauthenticated: the credential is invalid or expired.",
                               {"WWW-Authenticate": 'Firebase realm="firebasestorage"'})
        if req.kind == "list":
            return self._list(req, query, principal)
        return self._object(req, query, principal)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    # -------------------------------------------------------------- list
    def _list(self, req: V0Request, query: dict[str, str], principal: Principal | None) -> None:
        fb = self.owner
        prefix, delimiter = req.prefix or "", query.get("delimiter") or "/"
        if prefix and (not prefix.endswith("/") or prefix.endswith("//")):
            req.status, req.reason = 400, "bad prefix"
            return self._error(400, BAD_PREFIX_MESSAGE)
        size = DEFAULT_PAGE
        if req.max_results is not None:
            if not req.max_results.isdigit() or int(req.max_results) < 1:
                req.status, req.reason = 400, "bad maxResults"
                return self._error(400, "Invalid maxResults")
            size = min(int(req.max_results), DEFAULT_PAGE)
        size = max(1, min(size, fb.max_page_size))
        if not fb.allowed(prefix, principal):
            req.status, req.reason = 403, f"rules deny LIST {prefix!r}"
            return self._error(403, "Permission denied. No LIST permission.")
        items, prefixes = fb._gcs_list(req.bucket, prefix, delimiter)
        items.sort()
        if req.page_token:
            try:
                items = items[items.index(req.page_token):]
            except ValueError:
                pass                  # a token naming no item restarts (§7.10)
        next_token = None
        if fb.empty_first_page and not req.page_token and items:
            page, next_token = [], items[0]
        else:
            page = items[:size]
            if len(items) > size:
                next_token = items[size]
        body = {"prefixes": sorted(p for p in prefixes if valid_v0_name(p[:-1])),
                "items": [{"name": n, "bucket": req.bucket} for n in page
                          if n != prefix and valid_v0_name(n)]}
        if next_token is not None:
            body["nextPageToken"] = next_token
        req.status = 200
        self._send(200, body)

    # -------------------------------------------------------------- metadata and media
    def _object(self, req: V0Request, query: dict[str, str], principal: Principal | None) -> None:
        fb = self.owner
        res = fb._gcs_object(req.bucket, req.name)
        tokens = [t for t in ((res or {}).get("metadata") or {}).get(TOKENS_KEY, "").split(",") if t]
        by_token = req.kind == "media" and "token" in query and query["token"] in tokens
        if not by_token and not fb.allowed(req.name, principal):
            req.status, req.reason = 403, f"rules deny READ {req.name!r}"
            return self._error(403, "Permission denied. No READ permission.")
        if res is None:
            req.status = 404
            return self._send(404, "Not Found", "text/plain; charset=utf-8")
        res = fb.ensure_token(req.bucket, res)
        meta = fb._to_v0(res)
        if req.kind == "metadata":
            if fb.metadata_delay:
                time.sleep(fb.metadata_delay)
            req.status = 200
            return self._send(200, meta)
        return self._media(req, res, meta)

    def _media(self, req: V0Request, res: dict, meta: dict) -> None:
        fb = self.owner
        if fb.media_delay:
            time.sleep(fb.media_delay)
        path = (f"/download/storage/v1/b/{quote_name(req.bucket)}/o/{quote_name(req.name)}"
                f"?alt=media&generation={meta['generation']}")
        headers = {}
        if self.headers.get("Accept-Encoding"):
            headers["Accept-Encoding"] = self.headers["Accept-Encoding"]
        if req.range:
            headers["Range"] = req.range
        status, resp, _ = fb._upstream("GET", path, headers=headers, stream=True)
        if status == 416 and fb.unsatisfiable_range == "ignore":
            resp.read()
            headers.pop("Range", None)
            status, resp, _ = fb._upstream("GET", path, headers=headers, stream=True)
        if status not in (200, 206):
            data = resp.read()
            req.status = status
            if status == 404:
                return self._send(404, "Not Found", "text/plain; charset=utf-8")
            return self._send(status, data, resp.getheader("Content-Type", "text/plain"))
        last = req.name.rsplit("/", 1)[-1]
        self.send_response(status)
        self.send_header("Content-Type", resp.getheader("Content-Type") or meta["contentType"])
        self.send_header("Content-Disposition",
                         f"attachment; filename*={urllib.parse.quote(last, safe='')}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", meta.get("etag", ""))
        self.send_header("Cache-Control", meta.get("cacheControl", ""))
        self.send_header("Content-Encoding", resp.getheader("Content-Encoding") or "")
        self.send_header("x-goog-generation", meta["generation"])
        self.send_header("x-goog-metadatageneration", meta["metageneration"])
        self.send_header("x-goog-storage-class", meta["storageClass"])
        if resp.getheader("X-Goog-Hash"):
            self.send_header("x-goog-hash", resp.getheader("X-Goog-Hash"))
        if resp.getheader("Content-Range"):
            self.send_header("Content-Range", resp.getheader("Content-Range"))
        clen = resp.getheader("Content-Length")
        chunked = clen is None
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", clen)
        self.end_headers()
        req.status = status
        if self.command == "HEAD":
            resp.read()
            return
        sent = 0
        try:
            while True:
                chunk = resp.read1(256 * 1024)
                if not chunk:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                sent += len(chunk)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
            if resp.will_close:
                fb._drop_conn()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            fb._drop_conn()          # the upstream body was not drained
        finally:
            with fb._lock:
                fb.media_bytes += sent
