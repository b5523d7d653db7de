"""TLS: what storefs trusts, how it fails, what it offers (issue 42; tls-contract.md).

Servers are tls_fixture's: `TLSFront` (TLS in front of the emulator's plain port, ALPN
`http/1.1` only, its certificate swappable), `ALPNSniffer` (reads the ClientHello's ALPN, then
splices to the real TLS server), `RecordingTLSServer` (records every decrypted request). The
emulator itself speaks HTTP/2 and HTTP/1.1 over TLS. Runs that must fail use the factories'
`argv`/`command` and `run_storefs`; each failure must be exit 1 (TLS) or non-zero (ca_file=),
one `storefs: ` line naming the problem, and no mount, no lingering process.

Tests that need a known trust store (no CA given, CURL_CA_BUNDLE / SSL_CERT_FILE) run through
`bare_mount` (`env -i`): this machine's environment sets CURL_CA_BUNDLE itself.
STOREFS_TLS_SHOW=1 (with `-s`) prints each failure line storefs gave.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import ssl
import subprocess
import time
import warnings

import pytest

from cryptography.hazmat.primitives import serialization

import tls_fixture
from storefs_testlib import (BUCKET, EXIT_TIMEOUT_S, is_mounted, pid_alive, pids_with_arg,
                             read_whole, run_storefs, wait_pid_gone)
from tls_fixture import ALPNSniffer, ConnectionCounter, RecordingTLSServer, TLSFront

HELLO = "files/hello.txt"
LINES = "files/lines.txt"


# ---------------------------------------------------------------- helpers
@pytest.fixture
def front(emulator):
    """A TLS front (the session's good certificate, ALPN http/1.1 only) before the emulator."""
    f = TLSFront(emulator.http_endpoint).start()
    yield f
    f.stop()


def _front_with(emulator, request, cert: str, **ctx) -> TLSFront:
    f = TLSFront(emulator.http_endpoint, tls_fixture.session().server_context(cert, **ctx)).start()
    request.addfinalizer(f.stop)
    return f


def _fails(argv: list[str], mnt: str, *needles: str, code: int | None = 1) -> str:
    """Runs a storefs that must fail before mounting; returns its one stderr line."""
    r = run_storefs(argv, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode != 0, f"exit 0; stderr={r.stderr!r}"
    if code is not None:
        assert r.returncode == code, f"exit {r.returncode}, expected {code}; stderr={r.stderr!r}"
    assert len(lines) == 1 and lines[0].startswith("storefs: "), \
        f"stderr must be exactly one 'storefs: ' line, got {r.stderr!r}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    if os.environ.get("STOREFS_TLS_SHOW"):
        print(f"\n  exit {r.returncode}: {lines[0]}")
    assert not is_mounted(mnt), f"{mnt} is mounted although storefs failed"
    time.sleep(0.1)
    assert [p for p in pids_with_arg(mnt) if pid_alive(p)] == [], "a storefs process lingers"
    return lines[0]


def _mount_fails(mount, endpoint: str, *needles: str, options=(), foreground=False,
                 code: int | None = 1, **kwargs) -> str:
    mnt = mount.new_dir("mnt")
    argv, cache = mount.argv(BUCKET, mnt, endpoint=endpoint, options=list(options),
                             foreground=foreground, **kwargs)
    mount.adopt(mnt, cache)   # teardown cleans up if storefs mounts anyway
    return _fails(argv, mnt, *needles, code=code)


def _bare_fails(bare_mount, endpoint: str, *needles: str, options=("anonymous",), env=None,
                ca_file=None, code: int | None = 1) -> str:
    argv, mnt = bare_mount.command(BUCKET, endpoint=endpoint, options=list(options), env=env,
                                   foreground=False, ca_file=ca_file)
    return _fails(argv, mnt, *needles, code=code)


def _origin(url: str) -> str:
    return url.rstrip("/")


# ---------------------------------------------------------------- certificate failures at mount
CERT_FAILURES = {
    "self_signed": ("is not signed by a CA storefs trusts", "ca_file="),
    "wrong_host": ("does not name",),
    "expired": ("has expired",),
    "not_yet_valid": ("is not valid yet",),
}


@pytest.mark.parametrize("foreground", [False, True], ids=["daemon", "fg"])
@pytest.mark.parametrize("cert", list(CERT_FAILURES))
def test_a_bad_certificate_fails_the_mount_with_one_line_saying_what(mount, emulator, request,
                                                                     cert, foreground):
    f = _front_with(emulator, request, cert)
    line = _mount_fails(mount, f.https_url, *CERT_FAILURES[cert], _origin(f.https_url),
                        foreground=foreground)
    assert f.connections >= 1, f"storefs never connected; it said {line!r}"
    if cert != "wrong_host":     # libcurl checks the name after OpenSSL's handshake is done
        assert f.handshake_errors and f.alpn_chosen == [], \
            f"a handshake with a bad certificate completed; storefs said {line!r}"


def test_a_certificate_of_an_unknown_ca_fails_when_no_ca_is_given(bare_mount, front):
    """The session CA is in no system store: without ca_file= (and a clean environment) the
    good certificate of the front is from an unknown issuer."""
    _bare_fails(bare_mount, front.https_url, "is not signed by a CA storefs trusts", "ca_file=",
                _origin(front.https_url), ca_file=None)
    assert front.handshake_errors and front.alpn_chosen == []


def test_https_to_a_plain_http_port_is_a_handshake_failure_not_retried(mount, emulator):
    t0 = time.monotonic()
    url = emulator.http_endpoint.replace("http://", "https://")
    _mount_fails(mount, url, "TLS handshake with", _origin(url))
    assert time.monotonic() - t0 < 10, "a TLS failure must not be retried with backoff"


def test_a_server_speaking_only_tls_1_1_is_a_handshake_failure(mount, emulator, request):
    """libcurl and OpenSSL 3 refuse TLS < 1.2: no common version, no session."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # TLS 1.1 is the point here
        ctx = tls_fixture.session().server_context("server", maximum=ssl.TLSVersion.TLSv1_1)
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    f = TLSFront(emulator.http_endpoint, ctx).start()
    request.addfinalizer(f.stop)
    _mount_fails(mount, f.https_url, "TLS handshake with", _origin(f.https_url))
    assert f.handshake_errors


# ---------------------------------------------------------------- ca_file= itself
def test_ca_file_that_does_not_exist(mount, front, tmp_path):
    path = str(tmp_path / "absent.pem")
    _mount_fails(mount, front.https_url, f"ca_file={path}", "cannot read it", ca_file=path,
                 code=None)
    assert front.connections == 0, "ca_file= must be checked before any connection"


@pytest.mark.parametrize("what", ["junk", "empty", "key_only"])
def test_ca_file_without_a_pem_certificate(mount, front, tmp_path, what):
    path = str(tmp_path / f"{what}.pem")
    with open(path, "wb") as f:
        if what == "junk":
            f.write(b"this is not a certificate\n" + os.urandom(64))
        elif what == "key_only":
            with open(tls_fixture.session().server.key_path, "rb") as k:
                f.write(k.read())
    _mount_fails(mount, front.https_url, f"ca_file={path}", "holds no PEM certificate",
                 ca_file=path, code=None)
    assert front.connections == 0, "ca_file= must be checked before any connection"


def test_ca_file_that_is_a_directory(mount, front, tmp_path):
    """The contract names missing and unparsable files; a directory is said as such."""
    path = str(tmp_path)
    _mount_fails(mount, front.https_url, f"ca_file={path}", "is not a regular file", ca_file=path,
                 code=None)
    assert front.connections == 0


def test_ca_file_of_another_ca_is_an_unknown_issuer(mount, front, tmp_path):
    other = tls_fixture.session().write_bundle(str(tmp_path / "other.pem"),
                                               tls_fixture.session().self_signed)
    _mount_fails(mount, front.https_url, "is not signed by a CA storefs trusts", ca_file=other)


def test_ca_file_with_junk_around_the_ca_still_works(mount, front, corpus, tmp_path):
    """A bundle is PEM blocks among other text (as system bundles carry comments)."""
    s = tls_fixture.session()
    path = s.write_bundle(str(tmp_path / "bundle.pem"), s.self_signed, s.server,
                          junk=b"# a comment line\n")
    with open(path, "ab") as f:
        f.write(s.ca_cert.public_bytes(serialization.Encoding.PEM) + b"trailing\n")
    m = mount(endpoint=front.https_url, ca_file=path)
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO]


# ---------------------------------------------------------------- no way to turn verification off
@pytest.mark.parametrize("opt", ["insecure", "ssl_verify=0", "tls_verify=off", "verify=false",
                                 "ssl_no_verify", "tls_insecure=1", "ca_file="])
def test_no_option_weakens_verification(mount, emulator, request, opt):
    f = _front_with(emulator, request, "self_signed")
    code = None if opt == "ca_file=" else 2
    needle = "ca_file" if opt == "ca_file=" else "unknown option"
    _mount_fails(mount, f.https_url, needle, options=[opt], ca_file=None, code=code)
    assert f.alpn_chosen == [], "no TLS session may be made with an unverified certificate"


# ---------------------------------------------------------------- trust from the environment
def test_curl_ca_bundle_is_honoured_without_ca_file(bare_mount, front, corpus, tls):
    m = bare_mount(BUCKET, endpoint=front.https_url, options=["anonymous"], ca_file=None,
                   env={"CURL_CA_BUNDLE": tls.ca_file})
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO]


def test_ssl_cert_file_is_honoured_without_ca_file(bare_mount, front, corpus, tls):
    m = bare_mount(BUCKET, endpoint=front.https_url, options=["anonymous"], ca_file=None,
                   env={"SSL_CERT_FILE": tls.ca_file})
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO]


def test_curl_ca_bundle_comes_before_ssl_cert_file(bare_mount, front, tls, tmp_path):
    other = tls.write_bundle(str(tmp_path / "other.pem"), tls.self_signed)
    _bare_fails(bare_mount, front.https_url, "is not signed by a CA storefs trusts",
                env={"CURL_CA_BUNDLE": other, "SSL_CERT_FILE": tls.ca_file})


def test_ca_file_wins_over_the_environment(bare_mount, front, corpus, tls, tmp_path):
    other = tls.write_bundle(str(tmp_path / "other.pem"), tls.self_signed)
    _bare_fails(bare_mount, front.https_url, "is not signed by a CA storefs trusts",
                env={"CURL_CA_BUNDLE": tls.ca_file, "SSL_CERT_FILE": tls.ca_file}, ca_file=other)
    m = bare_mount(BUCKET, endpoint=front.https_url, options=["anonymous"], ca_file=tls.ca_file,
                   env={"CURL_CA_BUNDLE": other, "SSL_CERT_FILE": other})
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO]


# ---------------------------------------------------------------- credentials and verification
def _token_file(tmp_path) -> tuple[str, str]:
    token = "ya29.tls-secret-" + hashlib.sha256(os.urandom(16)).hexdigest()[:24]
    path = str(tmp_path / "token")
    with open(path, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return path, token


def test_the_recorder_sees_the_token_over_a_verified_connection(bare_mount, tls, tmp_path, request):
    """The control for the next test: with a certificate storefs trusts, the recorder does see
    the request and its Authorization header."""
    rec = RecordingTLSServer(tls.server_context("server")).start()
    request.addfinalizer(rec.stop)
    tf, token = _token_file(tmp_path)
    argv, mnt = bare_mount.command(BUCKET, endpoint=rec.https_url, options=[f"token_file={tf}"],
                                   foreground=False)
    run_storefs(argv, timeout=60)      # mounted or not: what matters is what arrived
    assert rec.requests, "storefs sent nothing to a server it trusts"
    assert any(r.headers.get("authorization") == f"Bearer {token}" for r in rec.requests), \
        [r.request_line for r in rec.requests]


@pytest.mark.parametrize("cert", ["self_signed", "wrong_host", "expired"])
def test_no_request_and_no_token_before_the_certificate_is_verified(bare_mount, tls, tmp_path,
                                                                    request, cert):
    rec = RecordingTLSServer(tls.server_context(cert)).start()
    request.addfinalizer(rec.stop)
    tf, token = _token_file(tmp_path)
    _bare_fails(bare_mount, rec.https_url, *CERT_FAILURES[cert][:1], options=[f"token_file={tf}"],
                ca_file=tls.ca_file)
    assert rec.connections >= 1, "storefs never tried the server"
    assert rec.requests == [], \
        f"requests reached a server whose certificate failed: {rec.requests}"


def test_no_key_grant_reaches_a_token_service_whose_certificate_fails(bare_mount, gcs_auth_proxy,
                                                                    auth_server, tls, tmp_path,
                                                                    request):
    """A service-account key: the signed JWT grant is a secret too. Its token service
    (`auth_endpoint=`) presents a self-signed certificate: the mount fails saying so, and the
    service saw no request."""
    rec = RecordingTLSServer(tls.server_context("self_signed")).start()
    request.addfinalizer(rec.stop)
    key = auth_server.make_service_account_key(str(tmp_path / "sa.json"))
    line = _bare_fails(bare_mount, gcs_auth_proxy.endpoint, "is not signed by a CA storefs trusts",
                       _origin(rec.https_url),
                       options=[f"credentials={key.path}", f"auth_endpoint={rec.https_url}"],
                       ca_file=tls.ca_file, code=None)
    assert rec.connections >= 1 and rec.requests == [], rec.requests
    assert gcs_auth_proxy.checks == [], "a storage request went out without a token"
    assert not any(frag in line for frag in key.secret_fragments())


def test_a_redirect_from_https_to_http_is_not_followed(bare_mount, tls, tmp_path, request):
    plain = ConnectionCounter().start()
    request.addfinalizer(plain.stop)
    rec = RecordingTLSServer(tls.server_context("server")).start()
    request.addfinalizer(rec.stop)
    rec.location = f"{plain.http_url}/storage/v1/b/{BUCKET}/o"
    tf, token = _token_file(tmp_path)
    argv, mnt = bare_mount.command(BUCKET, endpoint=rec.https_url, options=[f"token_file={tf}"],
                                   foreground=False)
    r = run_storefs(argv, timeout=60)
    assert r.returncode != 0, "a mount whose bucket check was answered 302 must fail"
    assert rec.requests, "storefs never reached the https server"
    assert plain.connections == 0, "storefs followed a redirect to http://"
    assert token not in r.stderr


# ---------------------------------------------------------------- HTTP versions
def _exact_reads(m, corpus) -> None:
    assert sorted(os.listdir(m.p("files"))) == sorted(
        n.split("/", 1)[1] for n in corpus.data if n.startswith("files/"))
    assert sorted(os.listdir(m.p("odd"))) == sorted(n.split("/", 1)[1] for n in corpus.ODD)
    assert len(os.listdir(m.p("dir1500"))) == 1500
    for name in (HELLO, LINES, corpus.ZERO, corpus.GZIP, corpus.ODD[5]):
        assert read_whole(m.p(name)) == corpus.data[name], name
    assert hashlib.sha256(read_whole(m.p(corpus.BIG))).hexdigest() == corpus.sha256(corpus.BIG)


def _versions_logged(m) -> set[str]:
    return set(re.findall(r"msg=http .* http=(\S+)", m.stderr()))


@pytest.mark.parametrize("version", ["1.1", "2"])
@pytest.mark.parametrize("server", ["h2_emulator", "http11_front"])
def test_reads_and_listings_are_exact_over_each_http_version(mount, emulator, front, corpus,
                                                             server, version):
    endpoint = emulator.endpoint if server == "h2_emulator" else front.https_url
    m = mount(endpoint=endpoint, options=[f"http_version={version}", "log_level=debug"])
    _exact_reads(m, corpus)
    used = "2" if (server == "h2_emulator" and version == "2") else "1.1"
    assert _versions_logged(m) == {used}, \
        f"http= fields logged: {_versions_logged(m)}, expected only {used}"
    if server == "http11_front":
        assert front.alpn_chosen and set(front.alpn_chosen) == {"http/1.1"}, front.alpn_chosen


@pytest.mark.parametrize("version,offer", [("1.1", ["http/1.1"]), ("2", ["h2", "http/1.1"])])
def test_alpn_offers_what_http_version_says(mount, emulator, corpus, version, offer, request):
    sniffer = ALPNSniffer(emulator.endpoint).start()
    request.addfinalizer(sniffer.stop)
    m = mount(endpoint=sniffer.https_url, options=[f"http_version={version}", "log_level=debug"])
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO]
    assert sniffer.errors == []
    assert sniffer.offers, "no ClientHello went through the sniffer"
    assert all(o == offer for o in sniffer.offers), f"offered {sniffer.offers}, expected {offer}"
    assert _versions_logged(m) == {"1.1" if version == "1.1" else "2"}


def test_the_default_http_version_is_1_1(mount, emulator, corpus, request):
    sniffer = ALPNSniffer(emulator.endpoint).start()
    request.addfinalizer(sniffer.stop)
    m = mount(endpoint=sniffer.https_url, options=["log_level=debug"])
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO]
    assert sniffer.offers and all(o == ["http/1.1"] for o in sniffer.offers), sniffer.offers
    assert _versions_logged(m) == {"1.1"}


def test_never_h2_over_plain_http(mount, emulator, corpus):
    """Plain-http behaviour (the emulator's plain port): http_version=2 still speaks 1.1."""
    m = mount(endpoint=emulator.http_endpoint, options=["http_version=2", "log_level=debug"])
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO]
    assert _versions_logged(m) == {"1.1"}


# ---------------------------------------------------------------- a bad certificate mid-life
@pytest.mark.parametrize("cert", ["self_signed", "expired"])
def test_a_certificate_gone_bad_during_the_mount_is_eio_and_the_cache_still_serves(mount, front,
                                                                                  corpus, cert):
    """The front starts presenting a bad certificate and drops its connections: reads
    of files never fetched fail with EIO at once, about one handshake per read (never
    retried), at most one log line per file however often it is read; cached bytes are still
    served."""
    m = mount(endpoint=front.https_url, options=["stat_ttl=600", "list_ttl=600", "read_ahead=0"])
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO]
    uncached = [LINES, corpus.ODD[0], corpus.ODD[2]]
    for name in uncached:
        os.stat(m.p(name))                     # metadata known; the bytes never fetched
    front.context = tls_fixture.session().server_context(cert)
    front.drop_connections()
    before = len(front.handshake_errors)
    t0 = time.monotonic()
    for name in uncached * 2:
        with pytest.raises(OSError) as exc:
            read_whole(m.p(name))
        assert exc.value.errno == errno.EIO, f"{name}: errno {exc.value.errno}, expected EIO"
    took = time.monotonic() - t0
    assert took < 10, f"6 failing reads took {took:.1f} s: a TLS failure must not be retried"
    # One handshake per read; storefs may also open a connection ahead of need (which fails
    # the same way), but a retried failure would be two or more per read.
    failed = len(front.handshake_errors) - before
    assert 1 <= failed < 12, f"{failed} failed handshakes for 6 reads: TLS failures are not retried"
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO], "cached bytes must still be served"
    logged = [ln for ln in m.stderr().splitlines() if CERT_FAILURES[cert][0] in ln]
    assert 1 <= len(logged) <= len(uncached), "\n".join(logged)


# ---------------------------------------------------------------- plain http (unchanged rules)
def test_credentials_over_plain_http_go_to_loopback_only(bare_mount, emulator, corpus, tmp_path):
    """Plain-http behaviour on purpose: a token over http:// is refused for a remote host
    before any connection, and allowed to this machine (the emulator's plain port)."""
    tf, token = _token_file(tmp_path)
    line = _bare_fails(bare_mount, f"http://{tls_fixture.OTHER_HOST}:8080",
                       "refusing to send credentials over plain http", options=[f"token_file={tf}"],
                       code=None)
    assert token not in line
    m = bare_mount(BUCKET, endpoint=emulator.http_endpoint, options=[f"token_file={tf}"])
    assert read_whole(m.p(HELLO)) == corpus.data[HELLO]


# ---------------------------------------------------------------- exit while TLS is in flight
def test_unmount_while_tls_handshakes_are_in_flight_ends_the_process(mount, emulator, request):
    """storefs must be gone soon after its unmount even when background requests (the listing
    prefetch a readdir starts) are in their TLS handshake: here every ClientHello is held
    50 ms, and the unmount comes right after `ls`, up to 16 times (measured: about one round
    in four hangs, whatever the delay up to 0.1 s; none at 0.3 s, when exit() is over first). Fails on fbc5e60..26924ca
    (a storefs bug, reported to the lead; gdb: main is in exit() -> OPENSSL_cleanup, a
    prefetchListings thread then faults inside a TLS handshake on OpenSSL's freed state, and
    the Swift runtime's crash handler pauses every thread and never ends the process). The
    same hang shows in other files as "storefs pid N still alive 10 s after unmount" now and
    then; over plain http it never happens."""
    sniffer = ALPNSniffer(emulator.endpoint, hello_delay=0.05).start()
    request.addfinalizer(sniffer.stop)
    stuck = []
    for i in range(16):
        m = mount(endpoint=sniffer.https_url)
        os.listdir(m.p())                     # starts listing prefetches of the subdirectories
        r = subprocess.run(["fusermount3", "-u", m.path], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        if not wait_pid_gone(m.pid, EXIT_TIMEOUT_S):
            stuck.append(f"round {i}: pid {m.pid} alive {EXIT_TIMEOUT_S:.0f} s after its "
                         f"unmount; stderr tail: {m.stderr()[-300:]!r}")
            break
    assert stuck == [], "\n".join(stuck)
