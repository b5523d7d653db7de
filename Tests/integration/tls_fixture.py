"""Throwaway TLS material and TLS test servers for the storefs integration suite (issue 42).

Every user reaches Google over https, so the suite's servers speak TLS where users are on TLS.
`session()` makes, once per process, in a private (0700) temp directory removed at exit:

- a CA (`ca_file`: its certificate, the PEM bundle mounts get as `ca_file=`; its key stays in
  the directory, mode 0600, and in memory);
- `server`: a leaf for `127.0.0.1` (IP SAN) and `localhost` signed by the CA, what every
  TLS fixture presents;
- for the failure tests, each signed by the CA unless said: `expired` (valid until yesterday),
  `not_yet_valid` (from tomorrow), `wrong_host` (only `storage.example.test`), and
  `self_signed` (127.0.0.1, signed by itself, not by the CA).

`server_context(name, alpn=...)` and `client_context()` build Python `ssl` contexts; the
servers here:

- `TLSFront`: terminates TLS (ALPN `http/1.1` only by default, so an HTTP/1.1-only TLS
  server) and splices the decrypted bytes to a plain upstream (`emulator.http_endpoint`);
  its context can be swapped and its open connections dropped, to make a live server start
  presenting a bad certificate.
- `ALPNSniffer`: TCP only: reads each ClientHello, records the ALPN protocols offered
  (`offers`), then splices the bytes unchanged to a real TLS server.
- `RecordingTLSServer`: TLS with any certificate; records every decrypted request line and
  header block it receives (`requests`) and handshake failures (`handshake_errors`).
- `ConnectionCounter`: a plain TCP port that counts connections (a redirect target).

Only the standard library and `cryptography` are used.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import ipaddress
import os
import shutil
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
except ImportError as exc:   # every TLS fixture needs it: say what to do, loudly
    raise ImportError(f"tls_fixture needs the PyPI package cryptography ({exc}); "
                      "run scripts/install-deps") from exc

HTTP11 = ("http/1.1",)
H2_AND_HTTP11 = ("h2", "http/1.1")
OTHER_HOST = "storage.example.test"
HANDSHAKE_TIMEOUT_S = 10.0


# ====================================================================== certificates
@dataclass
class CertFiles:
    """One certificate and its key, as PEM files in the session directory."""

    name: str
    cert_path: str
    key_path: str
    cert: x509.Certificate

    def pem(self) -> bytes:
        with open(self.cert_path, "rb") as f:
            return f.read()


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "storefs tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: str, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class TLSMaterial:
    """The session CA and its certificates (see the module doc). `close()` removes the files."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="storefs-tls-")     # mkdtemp makes it 0700
        os.chmod(self.dir, 0o700)
        now = _dt.datetime.now(_dt.timezone.utc)
        self._now = now
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ca_cert = (x509.CertificateBuilder()
                        .subject_name(_name("storefs test CA"))
                        .issuer_name(_name("storefs test CA"))
                        .public_key(self.ca_key.public_key())
                        .serial_number(x509.random_serial_number())
                        .not_valid_before(now - _dt.timedelta(days=1))
                        .not_valid_after(now + _dt.timedelta(days=7))
                        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                                     crl_sign=True, content_commitment=False,
                                                     key_encipherment=False, data_encipherment=False,
                                                     key_agreement=False, encipher_only=False,
                                                     decipher_only=False), critical=True)
                        .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                            self.ca_key.public_key()), critical=False)
                        .sign(self.ca_key, hashes.SHA256()))
        self.ca_file = os.path.join(self.dir, "ca.pem")
        _write(self.ca_file, self.ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        _write(os.path.join(self.dir, "ca-key.pem"), self.ca_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        day = _dt.timedelta(days=1)
        local = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        self.server = self._leaf("server", local, now - day, now + 7 * day)
        self.expired = self._leaf("expired", local, now - 3 * day, now - day)
        self.not_yet_valid = self._leaf("not-yet-valid", local, now + day, now + 3 * day)
        self.wrong_host = self._leaf("wrong-host", [x509.DNSName(OTHER_HOST)], now - day, now + 7 * day)
        self.self_signed = self._leaf("self-signed", local, now - day, now + 7 * day, self_signed=True)

    def _leaf(self, name: str, sans: list, not_before, not_after, self_signed: bool = False
              ) -> CertFiles:
        key = ec.generate_private_key(ec.SECP256R1())
        cn = "127.0.0.1" if name != "wrong-host" else OTHER_HOST
        issuer_key = key if self_signed else self.ca_key
        builder = (x509.CertificateBuilder()
                   .subject_name(_name(cn))
                   .issuer_name(_name(cn) if self_signed else self.ca_cert.subject)
                   .public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(not_before)
                   .not_valid_after(not_after)
                   .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                                  critical=False))
        if not self_signed:
            builder = builder.add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()),
                critical=False)
        cert = builder.sign(issuer_key, hashes.SHA256())
        cert_path = os.path.join(self.dir, f"{name}.pem")
        key_path = os.path.join(self.dir, f"{name}-key.pem")
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        _write(key_path, key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        return CertFiles(name, cert_path, key_path, cert)

    def cert(self, name: str) -> CertFiles:
        """`server`, `expired`, `not_yet_valid`, `wrong_host` or `self_signed`."""
        found = getattr(self, name.replace("-", "_"), None)
        if not isinstance(found, CertFiles):
            raise KeyError(f"no certificate named {name!r}")
        return found

    def server_context(self, name: str = "server", alpn: tuple[str, ...] | None = HTTP11, *,
                       minimum: ssl.TLSVersion | None = None,
                       maximum: ssl.TLSVersion | None = None) -> ssl.SSLContext:
        """A server-side context presenting certificate `name`, offering `alpn` (None: no
        ALPN extension at all), limited to TLS versions [minimum, maximum] when given."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        c = self.cert(name)
        ctx.load_cert_chain(c.cert_path, c.key_path)
        if alpn:
            ctx.set_alpn_protocols(list(alpn))
        if minimum is not None:
            ctx.minimum_version = minimum
        if maximum is not None:
            ctx.maximum_version = maximum
        return ctx

    def client_context(self, alpn: tuple[str, ...] | None = None) -> ssl.SSLContext:
        """A client context trusting only the session CA (host names checked)."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if alpn:
            ctx.set_alpn_protocols(list(alpn))
        return ctx

    def write_bundle(self, path: str, *certs: CertFiles, junk: bytes = b"") -> str:
        """A PEM file holding the given certificates (the CA when none is given)."""
        data = b"".join(c.pem() for c in certs) if certs else \
            self.ca_cert.public_bytes(serialization.Encoding.PEM)
        _write(path, junk + data, 0o644)
        return path

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


_session: TLSMaterial | None = None
_session_lock = threading.Lock()


def session() -> TLSMaterial:
    """The process's TLS material, made on first use and removed at exit."""
    global _session
    with _session_lock:
        if _session is None:
            _session = TLSMaterial()
            atexit.register(_session.close)
        return _session


_client_ctx: ssl.SSLContext | None = None


def client_context() -> ssl.SSLContext:
    """One shared client context trusting the session CA (contexts are thread-safe)."""
    global _client_ctx
    with _session_lock:
        ctx = _client_ctx
    if ctx is None:
        ctx = session().client_context()
        with _session_lock:
            _client_ctx = _client_ctx or ctx
    return _client_ctx


# ====================================================================== servers
def _splice(a: socket.socket, b: socket.socket) -> None:
    """Copies a -> b until a ends, then half-closes b (at the socket level: SSLSocket.shutdown
    would also drop the TLS state another thread is reading with). Errors end the copy quietly."""
    try:
        while True:
            data = a.recv(256 * 1024)
            if not data:
                break
            b.sendall(data)
    except (OSError, ValueError):
        pass
    try:
        socket.socket.shutdown(b, socket.SHUT_WR)
    except (OSError, ValueError):
        pass


class _Acceptor:
    """A listener on a free 127.0.0.1 port; `serve(conn)` runs in a thread per connection.
    `stop()` closes the listener and every connection still open (by our own handles)."""

    thread_name = "tls-fixture"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self.connections = 0

    def start(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        self._listener = s
        self.port = s.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=self.thread_name, daemon=True).start()
        return self

    @property
    def https_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _accept_loop(self) -> None:
        listener = self._listener
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.track(conn, True)
            threading.Thread(target=self._run, args=(conn,), name=self.thread_name,
                             daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except (OSError, ValueError):
            pass
        finally:
            self.track(conn, False)
            try:
                conn.close()
            except OSError:
                pass

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def track(self, sock: socket.socket, alive: bool) -> None:
        with self._lock:
            (self._live.add if alive else self._live.discard)(sock)

    def drop_connections(self) -> None:
        """Ends every connection being served, those still in their TLS handshake included;
        the listener stays. (The socket-level shutdown, also on a TLS socket: the peer sees
        the connection end, and the thread serving it sees EOF.)"""
        with self._lock:
            live = list(self._live)
        for s in live:
            try:
                socket.socket.shutdown(s, socket.SHUT_RDWR)
            except OSError:
                pass

    def handshake(self, conn: socket.socket, context_of) -> ssl.SSLSocket:
        """Server-side TLS on `conn` with `context_of()`, read when the TLS socket is made and
        tracked at once under the lock, so a context swapped then `drop_connections()` leaves
        no connection made with the old one. Raises what the handshake raises."""
        with self._lock:
            tls = context_of().wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            self._live.discard(conn)
            self._live.add(tls)
        try:
            tls.do_handshake()
        except BaseException:
            self.track(tls, False)
            tls.close()
            raise
        return tls

    def handshake_or_note(self, conn: socket.socket, context_of) -> ssl.SSLSocket | None:
        """`handshake` within HANDSHAKE_TIMEOUT_S; a failure goes in `handshake_errors` (None)."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            return self.handshake(conn, context_of)
        except (ssl.SSLError, OSError) as exc:
            with self._lock:
                self.handshake_errors.append(f"{type(exc).__name__}: {exc}")
            return None

    def stop(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        self.drop_connections()


class TLSFront(_Acceptor):
    """A TLS terminator in front of a plain HTTP/1.1 upstream (`http://127.0.0.1:PORT`).

    `context` (default: the session's `server` cert, ALPN `http/1.1` only) is read for every
    new connection: assign another one, then `drop_connections()`, and the clients' next
    connection sees the new certificate. `alpn_chosen` lists what each handshake settled on
    (None when the client offered no ALPN); `handshake_errors` the failed handshakes.
    """

    thread_name = "tls-front"

    def __init__(self, upstream: str, context: ssl.SSLContext | None = None) -> None:
        super().__init__()
        host, _, port = upstream.split("://", 1)[1].rstrip("/").rpartition(":")
        self.upstream = (host, int(port))
        self.context = context or session().server_context("server", HTTP11)
        self.alpn_chosen: list[str | None] = []
        self.handshake_errors: list[str] = []

    def serve(self, conn: socket.socket) -> None:
        tls = self.handshake_or_note(conn, lambda: self.context)
        if tls is None:
            return
        try:
            tls.settimeout(None)
            with self._lock:
                self.alpn_chosen.append(tls.selected_alpn_protocol())
            up = socket.create_connection(self.upstream, timeout=30)
            up.settimeout(None)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.track(up, True)
            try:
                back = threading.Thread(target=_splice, args=(up, tls), daemon=True)
                back.start()
                _splice(tls, up)
                back.join()
            finally:
                self.track(up, False)
                up.close()
        finally:
            self.track(tls, False)
            tls.close()


def parse_client_hello_alpn(hello: bytes) -> list[str] | None:
    """The ALPN protocol names of a ClientHello handshake message (type byte included);
    None when it carries no ALPN extension. Raises ValueError on a malformed message."""
    if len(hello) < 4 or hello[0] != 1:
        raise ValueError("not a ClientHello")
    body = hello[4:4 + int.from_bytes(hello[1:4], "big")]
    i = 2 + 32                                   # client_version, random
    i += 1 + body[i]                             # session_id
    i += 2 + int.from_bytes(body[i:i + 2], "big")   # cipher_suites
    i += 1 + body[i]                             # compression_methods
    if i >= len(body):
        return None                              # no extensions at all
    end = i + 2 + int.from_bytes(body[i:i + 2], "big")
    i += 2
    while i + 4 <= end:
        etype = int.from_bytes(body[i:i + 2], "big")
        elen = int.from_bytes(body[i + 2:i + 4], "big")
        data = body[i + 4:i + 4 + elen]
        i += 4 + elen
        if etype == 16:                          # application_layer_protocol_negotiation
            names, j = [], 2
            while j < len(data):
                n = data[j]
                names.append(data[j + 1:j + 1 + n].decode("ascii", "replace"))
                j += 1 + n
            return names
    return None


class ALPNSniffer(_Acceptor):
    """TCP in front of a TLS server (`https://127.0.0.1:PORT`): records, per connection, the
    ALPN names the client's ClientHello offers (`offers`: a list per connection, None when
    it had no ALPN extension), then forwards every byte unchanged both ways. `hello_delay`
    holds each ClientHello back that long first (a client mid-handshake, on demand)."""

    thread_name = "alpn-sniffer"

    def __init__(self, upstream: str, hello_delay: float = 0.0) -> None:
        super().__init__()
        host, _, port = upstream.split("://", 1)[1].rstrip("/").rpartition(":")
        self.upstream = (host, int(port))
        self.hello_delay = hello_delay      # seconds each ClientHello is held before it goes on
        self.offers: list[list[str] | None] = []
        self.errors: list[str] = []

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        raw = b""          # every byte read so far, forwarded as it came
        while True:
            hs = self._handshake_bytes(raw)
            if hs is None:
                with self._lock:
                    self.errors.append(f"not a TLS handshake record: {raw[:16]!r}")
                return
            if len(hs) >= 4 and len(hs) >= 4 + int.from_bytes(hs[1:4], "big"):
                break                                # the whole ClientHello is here
            chunk = conn.recv(65536)
            if not chunk:
                return
            raw += chunk
        try:
            offered = parse_client_hello_alpn(hs)
        except (ValueError, IndexError) as exc:
            with self._lock:
                self.errors.append(f"unparsable ClientHello: {exc}")
            return
        with self._lock:
            self.offers.append(offered)
        if self.hello_delay:
            time.sleep(self.hello_delay)      # a far server: the client sits in its handshake
        conn.settimeout(None)
        up = socket.create_connection(self.upstream, timeout=30)
        up.settimeout(None)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.track(up, True)
        try:
            up.sendall(raw)
            back = threading.Thread(target=_splice, args=(up, conn), daemon=True)
            back.start()
            _splice(conn, up)
            back.join()
        finally:
            self.track(up, False)
            up.close()

    @staticmethod
    def _handshake_bytes(raw: bytes) -> bytes | None:
        """The handshake bytes of the complete records in `raw`; None if one is not a
        handshake record."""
        out, i = b"", 0
        while i + 5 <= len(raw):
            if raw[i] != 22:                         # handshake record
                return None
            n = int.from_bytes(raw[i + 3:i + 5], "big")
            if i + 5 + n > len(raw):
                break
            out += raw[i + 5:i + 5 + n]
            i += 5 + n
        return out


@dataclass
class RecordedRequest:
    request_line: str
    headers: dict[str, str]


class RecordingTLSServer(_Acceptor):
    """A TLS server with any context; after a handshake it reads HTTP/1.1 requests, records
    each one's request line and headers (`requests`), and answers `status` with `body`
    (default 200 and an empty listing), keep-alive. Failed handshakes go in `handshake_errors`.
    `location` set: answers 302 with that Location instead."""

    thread_name = "recording-tls"

    def __init__(self, context: ssl.SSLContext) -> None:
        super().__init__()
        self.context = context
        self.requests: list[RecordedRequest] = []
        self.handshake_errors: list[str] = []
        self.handshakes = 0
        self.location: str | None = None
        self.status = 200
        self.body = b'{"kind":"storage#objects","items":[],"prefixes":[]}'

    def serve(self, conn: socket.socket) -> None:
        tls = self.handshake_or_note(conn, lambda: self.context)
        if tls is None:
            return
        with self._lock:
            self.handshakes += 1
        try:
            tls.settimeout(30)
            f = tls.makefile("rb")
            while True:
                line = f.readline(65536)
                if not line:
                    return
                headers: dict[str, str] = {}
                while True:
                    h = f.readline(65536)
                    if h in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                with self._lock:
                    self.requests.append(RecordedRequest(line.decode("latin-1").strip(), headers))
                n = int(headers.get("content-length") or 0)
                if n:
                    f.read(n)
                if self.location:
                    head = (f"HTTP/1.1 302 Found\r\nLocation: {self.location}\r\n"
                            "Content-Length: 0\r\n\r\n").encode()
                    tls.sendall(head)
                else:
                    tls.sendall((f"HTTP/1.1 {self.status} OK\r\nContent-Type: application/json\r\n"
                                 f"Content-Length: {len(self.body)}\r\n\r\n").encode() + self.body)
        finally:
            self.track(tls, False)
            tls.close()


class ConnectionCounter(_Acceptor):
    """A plain TCP listener that only counts connections (`connections`) and closes them: the
    target of a redirect that must not be followed."""

    thread_name = "connection-counter"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self, conn: socket.socket) -> None:
        return
