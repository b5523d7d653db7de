"""Fixtures for the storefs integration suite (real FUSE mounts against fake-gcs-server).

TLS (issue 42): the suite runs where users are, on https. `tls` (session) is the
tls_fixture.TLSMaterial: a throwaway CA and certificates in a private 0700 temp dir
(`tls.ca_file`, `tls.server` for 127.0.0.1/localhost, and bad ones for test_tls.py). Every
server below that stands for a Google service serves https with `tls.server`; every mount the
factories make against an https endpoint gets `ca_file=<tls.ca_file>` (pass `ca_file=None`
to leave it out, or a path). What is plain http in real life stays plain: the GCE metadata
server, emulator host variables, and tests of plain-http rules (credentials over http go to
loopback only), which say so. Hops inside the test (proxy -> emulator) use the emulator's
plain port, and so do the HTTP-level models that stay plain both ways (FaultProxy, and
bench/link's linkproxy in test_link.py). test_tls.py has the TLS servers of its own
(tls_fixture: a swappable TLS front, an ALPN sniffer, a request recorder).

- `emulator` (session): a GCSEmulator (fake-gcs-server `-scheme both`) with bucket
  `test-bucket` holding the corpus (`storefs_testlib.Corpus`); `emulator.endpoint` is its
  https origin (HTTP/2 and HTTP/1.1 by ALPN), `emulator.http_endpoint` the plain one;
  `emulator.corpus` has the bytes and upload resources.
- `corpus` (session): that Corpus.
- `storefs_bin` (session): path of the binary (env STOREFS_BIN); fails when missing, and
  when /dev/fuse or the mount tools are not usable.
- `mount` (function): a MountManager; `mount(source, options=[...], endpoint=...,
  foreground=True, mountpoint=None, cwd=None)` returns a Mount once /proc/self/mountinfo
  lists it as fuse.storefs. Every mount is unmounted at teardown, whatever happened.
  `ca_file=` is added for https endpoints (above).
- `proxy` (function): a ForbiddingProxy (https) in front of the emulator's plain port (403
  under `private/`, request counts by kind in `proxy.counts`, `proxy.log`).

Firebase v0 and credentials (firebase_fixture.py, auth_fixture.py):
- `auth_server` (function): an AuthServer (Identity Toolkit, Secure Token, OAuth2 token and
  GCE metadata endpoints); storefs reaches the token services via `auth_endpoint=` (https,
  `auth_server.endpoint`) and the metadata server via `GCE_METADATA_HOST` (plain http,
  `auth_server.metadata_host`, a second port).
- `firebase` (function): a FirebaseStorageServer (v0 REST, https; `firebase.host` is its
  plain listener for FIREBASE_STORAGE_EMULATOR_HOST) over the `emulator`, verifying tokens
  with `auth_server`; rules default to everything public.
- `gcs_auth_proxy` (function): https; 401 unless a Bearer token `auth_server` issued, then
  forwards to the emulator.
- `bare_mount` (function): like `mount`, but nothing implicit (no `anonymous`, no endpoint,
  a clean environment whose proxy variables trap non-loopback requests in
  `auth_server.escapes` through its plain port); `ca_file=` still added for https
  endpoints; fails the test at teardown if any request tried to leave loopback.
- `fault_proxy` (function): a fault_proxy.FaultProxy, plain http on both sides (its
  docstring says why), in front of `emulator.http_endpoint`.

Nothing here skips: a missing prerequisite is a failure.
"""

from __future__ import annotations

import pytest

import tls_fixture
from firebase_fixture import FirebaseStorageServer
from gcs_emulator import GCSEmulator
from storefs_testlib import BUCKET, Corpus, ForbiddingProxy, MountManager, require_fuse, storefs_bin as _bin


@pytest.fixture(scope="session")
def tls() -> tls_fixture.TLSMaterial:
    try:
        return tls_fixture.session()
    except Exception as exc:
        pytest.fail(f"cannot make the session's TLS material: {exc!r}", pytrace=False)


@pytest.fixture(scope="session")
def emulator(tls):
    emu = GCSEmulator(tls=tls)
    try:
        emu.start()
    except Exception as exc:
        pytest.fail(f"cannot start fake-gcs-server: {exc}", pytrace=False)
    try:
        emu.create_bucket(BUCKET)
        corpus = Corpus()
        corpus.upload_all(emu, BUCKET)
        emu.corpus = corpus
        yield emu
    finally:
        emu.stop()


@pytest.fixture(autouse=True)
def _fake_gcs_server_outlives_the_test(request):
    """The session's fake-gcs-server serves every test after this one: if it died during this
    test, this test says so with the server's last output (the tests after it would only see
    refused connections)."""
    yield
    if "emulator" in request.fixturenames:
        gone = request.getfixturevalue("emulator").exited()
        if gone:
            pytest.fail(gone, pytrace=False)


@pytest.fixture(scope="session")
def corpus(emulator) -> Corpus:
    return emulator.corpus


@pytest.fixture(scope="session")
def storefs_bin() -> str:
    require_fuse()
    return _bin()


@pytest.fixture
def mount(emulator, storefs_bin, tls):
    manager = MountManager(emulator.endpoint, storefs_bin, ca_file=tls.ca_file)
    yield manager
    problems = manager.close()
    if problems:
        pytest.fail("mount cleanup: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def proxy(emulator):
    p = ForbiddingProxy(emulator.http_endpoint, aliases=[emulator.endpoint])
    p.start()
    yield p
    p.stop()


def _auth_fixture():
    """auth_fixture is imported on first use (it is heavy); like tls_fixture, which every
    fixture here uses, it needs `cryptography`, so without it the whole suite fails loudly."""
    try:
        import auth_fixture
    except ImportError as exc:
        pytest.fail(f"auth_fixture cannot be imported ({exc}); run scripts/install-deps",
                    pytrace=False)
    return auth_fixture


@pytest.fixture
def auth_server():
    a = _auth_fixture().AuthServer()
    a.start()
    yield a
    a.stop()


@pytest.fixture
def firebase(emulator, auth_server):
    fb = FirebaseStorageServer(emulator, auth_server)
    fb.start()
    yield fb
    fb.stop()


@pytest.fixture
def gcs_auth_proxy(emulator, auth_server):
    p = _auth_fixture().GCSAuthProxy(emulator.http_endpoint, auth_server,
                                     aliases=[emulator.endpoint])
    p.start()
    yield p
    p.stop()


@pytest.fixture
def bare_mount(storefs_bin, auth_server, tls):
    manager = _auth_fixture().ExplicitMountManager(storefs_bin, trap=auth_server.trap)
    manager.ca_file = tls.ca_file
    yield manager
    problems = manager.close()
    if auth_server.escapes:
        problems.append("storefs tried to leave loopback: " + ", ".join(auth_server.escapes))
    if problems:
        pytest.fail("bare_mount cleanup: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def fault_proxy(emulator):
    """A fault_proxy.FaultProxy in front of the emulator's plain port (plain http both ways; no
    faults until a test adds rules or a random plan); stopped at teardown, which releases
    every socket it holds."""
    from fault_proxy import FaultProxy
    p = FaultProxy(emulator.http_endpoint, aliases=[emulator.endpoint])
    p.start()
    yield p
    p.stop()
