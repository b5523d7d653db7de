"""The fixtures themselves: fake-gcs-server keeps awkward names, the proxy denies and forwards.

These need no storefs binary; if they fail, the other results mean nothing.
"""

import json
import urllib.error
import urllib.request

import pytest

import tls_fixture
from gcs_emulator import quote_name
from storefs_testlib import BUCKET, FORBIDDEN_BODY, classify


def _get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30, context=tls_fixture.client_context()) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_emulator_lists_back_every_name_exactly(emulator, corpus):
    items, _ = emulator.list_objects(BUCKET)
    assert sorted(i["name"] for i in items) == sorted(corpus.data)
    for name in corpus.ODD + corpus.HIDDEN + ["empty/", "clash", "clash/inner.txt"]:
        assert emulator.get_object(BUCKET, name)["name"] == name
        assert emulator.download(BUCKET, name) == corpus.data[name]


def test_emulator_keeps_gzip_bytes_as_stored(emulator, corpus):
    res = corpus.resources[corpus.GZIP]
    assert res["contentEncoding"] == "gzip"
    assert int(res["size"]) == len(corpus.data[corpus.GZIP])
    assert emulator.download(BUCKET, corpus.GZIP) == corpus.data[corpus.GZIP]


def test_quote_name_encodes_everything_but_unreserved():
    assert quote_name("a/b c+%#?~._-Z9") == "a%2Fb%20c%2B%25%23%3F~._-Z9"
    assert quote_name("ü/日", keep_slash=True) == "%C3%BC/%E6%97%A5"


def test_classify_decodes_names_and_prefixes():
    r = classify("GET", "/storage/v1/b/b/o/private%2Fa%2Bb.txt?alt=media")
    assert (r.kind, r.name) == ("media", "private/a+b.txt")
    r = classify("GET", "/download/storage/v1/b/b/o/x%2Fy")
    assert (r.kind, r.name) == ("media", "x/y")
    r = classify("GET", "/storage/v1/b/b/o/x%2Fy?fields=name")
    assert (r.kind, r.name) == ("metadata", "x/y")
    r = classify("GET", "/storage/v1/b/b/o?prefix=private%2Fsub%2F&delimiter=%2F&maxResults=1000")
    assert (r.kind, r.prefix) == ("list", "private/sub/")
    assert classify("GET", "/storage/v1/b/b").kind == "other"


def test_proxy_denies_private_and_forwards_the_rest(proxy, corpus):
    base = f"{proxy.endpoint}/storage/v1/b/{BUCKET}/o"
    secret = quote_name(corpus.PRIVATE)
    for url in (f"{base}/{secret}", f"{base}/{secret}?alt=media",
                f"{proxy.endpoint}/download/storage/v1/b/{BUCKET}/o/{secret}?alt=media",
                f"{base}?prefix=private%2F&delimiter=%2F"):
        status, headers, body = _get(url)
        assert status == 403, url
        assert body == FORBIDDEN_BODY
        assert json.loads(body)["error"]["errors"][0]["reason"] == "forbidden"
    big = quote_name(corpus.BIG)
    status, headers, body = _get(f"{base}/{big}?alt=media", {"Range": "bytes=100-199"})
    assert status == 206
    assert headers["Content-Range"] == f"bytes 100-199/{corpus.BIG_SIZE}"
    assert body == corpus.data[corpus.BIG][100:200]
    status, _, body = _get(f"{base}/{quote_name(corpus.GZIP)}?alt=media", {"Accept-Encoding": "gzip"})
    assert status == 200 and body == corpus.data[corpus.GZIP]
    status, _, body = _get(f"{base}/{quote_name('odd/a+b.txt')}")
    meta = json.loads(body)
    assert status == 200 and meta["name"] == "odd/a+b.txt"
    assert meta["mediaLink"].startswith(proxy.endpoint + "/")  # links lead back to the proxy
    status, _, body = _get(f"{base}?prefix=dir1500%2F&delimiter=%2F&maxResults=1000")
    page = json.loads(body)
    assert status == 200 and len(page["items"]) == 1000 and page["nextPageToken"]
    status, _, _ = _get(f"{base}/{quote_name('no/such')}")
    assert status == 404
    assert proxy.counts["denied"] == 4
    assert proxy.counts["list"] == 2 and proxy.counts["media"] == 4 and proxy.counts["metadata"] == 3


# ---------------------------------------------------------------- TLS fixtures (issue 42)
def test_tls_material_is_private_and_says_what_each_certificate_is(tls):
    import datetime as dt
    import ipaddress
    import os
    import stat
    from cryptography import x509
    assert stat.S_IMODE(os.stat(tls.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(tls.dir, "ca-key.pem")).st_mode) == 0o600
    now = dt.datetime.now(dt.timezone.utc)

    def sans(c):
        ext = c.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return set(ext.get_values_for_type(x509.IPAddress)), set(ext.get_values_for_type(x509.DNSName))

    assert sans(tls.server) == ({ipaddress.ip_address("127.0.0.1")}, {"localhost"})
    assert sans(tls.wrong_host) == (set(), {tls_fixture.OTHER_HOST})
    assert tls.expired.cert.not_valid_after_utc < now
    assert tls.not_yet_valid.cert.not_valid_before_utc > now
    for c in (tls.server, tls.expired, tls.not_yet_valid, tls.wrong_host):
        assert c.cert.issuer == tls.ca_cert.subject
    assert tls.self_signed.cert.issuer == tls.self_signed.cert.subject != tls.ca_cert.subject


def test_emulator_speaks_h2_and_http11_over_tls_and_plain_http(emulator, tls):
    import socket
    import ssl
    assert emulator.endpoint == f"https://127.0.0.1:{emulator.port}"
    assert emulator.http_endpoint == f"http://127.0.0.1:{emulator.http_port}"
    # Go's server picks h2 when offered; offered only http/1.1 it selects nothing (Go ignores
    # an ALPN mismatch when the client's only protocol is http/1.1) and speaks HTTP/1.1.
    for offer, want in ((["h2", "http/1.1"], {"h2"}), (["http/1.1"], {"http/1.1", None})):
        ctx = tls.client_context(alpn=tuple(offer))
        with socket.create_connection(("127.0.0.1", emulator.port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                assert s.selected_alpn_protocol() in want
                if offer == ["http/1.1"]:
                    s.sendall(b"GET /_internal/healthcheck HTTP/1.1\r\nHost: x\r\n"
                              b"Connection: close\r\n\r\n")
                    assert s.recv(64).startswith(b"HTTP/1.1 200")
    status, _, _ = emulator._request("GET", "/_internal/healthcheck")
    assert status == 200
    with pytest.raises(ssl.SSLCertVerificationError):   # not trusted without the CA
        with socket.create_connection(("127.0.0.1", emulator.port), timeout=10) as raw:
            ssl.create_default_context(cafile=tls.self_signed.cert_path).wrap_socket(
                raw, server_hostname="127.0.0.1")


def test_loopback_servers_handshake_in_the_connection_thread(proxy):
    """A client that connects and never sends its ClientHello holds up nobody else."""
    import socket
    import time
    assert proxy.endpoint.startswith("https://127.0.0.1:")
    stalled = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    try:
        t0 = time.monotonic()
        status, _, _ = _get(f"{proxy.endpoint}/storage/v1/b/{BUCKET}/o/{quote_name('files/hello.txt')}")
        assert status == 200 and time.monotonic() - t0 < 5
    finally:
        stalled.close()


def test_alpn_sniffer_reads_what_a_client_offers_and_passes_the_session(emulator, tls):
    import socket
    sniffer = tls_fixture.ALPNSniffer(emulator.endpoint).start()
    try:
        for offer in (("http/1.1",), ("h2", "http/1.1"), None):
            ctx = tls.client_context(alpn=offer)
            with socket.create_connection(("127.0.0.1", sniffer.port), timeout=10) as raw:
                with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    if offer == ("http/1.1",) or offer is None:
                        s.sendall(b"GET /_internal/healthcheck HTTP/1.1\r\nHost: x\r\n"
                                  b"Connection: close\r\n\r\n")
                        assert s.recv(64).startswith(b"HTTP/1.1 200")
        assert sniffer.offers == [["http/1.1"], ["h2", "http/1.1"], None], sniffer.offers
        assert sniffer.errors == []
    finally:
        sniffer.stop()


def test_tls_front_serves_http11_only_and_its_certificate_can_be_swapped(emulator, tls):
    import socket
    import ssl
    front = tls_fixture.TLSFront(emulator.http_endpoint).start()
    try:
        ctx = tls.client_context(alpn=("h2", "http/1.1"))
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                assert s.selected_alpn_protocol() == "http/1.1"
                s.sendall(b"GET /_internal/healthcheck HTTP/1.1\r\nHost: x\r\n\r\n")
                assert s.recv(64).startswith(b"HTTP/1.1 200")
                front.context = tls.server_context("expired")
                front.drop_connections()
                for _ in range(100):              # the open connection ends (after what was sent)
                    try:
                        if s.recv(65536) == b"":
                            break
                    except (ConnectionError, ssl.SSLError):
                        break
                else:
                    raise AssertionError("the connection outlived drop_connections()")
        with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
            with socket.create_connection(("127.0.0.1", front.port), timeout=10) as raw:
                ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    finally:
        front.stop()


def test_recording_tls_server_records_requests_and_failed_handshakes(tls):
    import http.client
    import ssl
    rec = tls_fixture.RecordingTLSServer(tls.server_context("server")).start()
    bad = tls_fixture.RecordingTLSServer(tls.server_context("self_signed")).start()
    try:
        c = http.client.HTTPSConnection("127.0.0.1", rec.port, context=tls.client_context(), timeout=10)
        c.request("GET", "/x", headers={"Authorization": "Bearer t"})
        assert c.getresponse().status == 200
        c.close()
        assert [(r.request_line, r.headers["authorization"]) for r in rec.requests] == \
            [("GET /x HTTP/1.1", "Bearer t")]
        c = http.client.HTTPSConnection("127.0.0.1", bad.port, context=tls.client_context(), timeout=10)
        with pytest.raises(ssl.SSLCertVerificationError):
            c.request("GET", "/x", headers={"Authorization": "Bearer t"})
        c.close()
        import time
        deadline = time.monotonic() + 5
        while not bad.handshake_errors and time.monotonic() < deadline:
            time.sleep(0.02)
        assert bad.requests == [] and bad.handshake_errors
    finally:
        rec.stop()
        bad.stop()
