"""Fixtures for the storefs integration suite (real FUSE mounts against fake-gcs-server).

- `emulator` (session): a GCSEmulator with bucket `test-bucket` holding the corpus
  (`storefs_testlib.Corpus`); `emulator.corpus` has the bytes and upload resources.
- `corpus` (session): that Corpus.
- `storefs_bin` (session): path of the binary (env STOREFS_BIN); fails when missing, and
  when /dev/fuse or the mount tools are not usable.
- `mount` (function): a MountManager; `mount(source, options=[...], endpoint=...,
  foreground=True, mountpoint=None, cwd=None)` returns a Mount once /proc/self/mountinfo
  lists it as fuse.storefs. Every mount is unmounted at teardown, whatever happened.
- `proxy` (function): a ForbiddingProxy in front of the emulator (403 under `private/`,
  request counts by kind in `proxy.counts`, `proxy.log`).

Firebase v0 and credentials (firebase_fixture.py, auth_fixture.py):
- `auth_server` (function): an AuthServer (Identity Toolkit, Secure Token, OAuth2 token and
  GCE metadata endpoints on one loopback port); storefs reaches it via `auth_endpoint=` and
  `GCE_METADATA_HOST`.
- `firebase` (function): a FirebaseStorageServer (v0 REST) over the `emulator`, verifying
  tokens with `auth_server`; rules default to everything public.
- `gcs_auth_proxy` (function): 401 unless a Bearer token `auth_server` issued, then forwards
  to the emulator.
- `bare_mount` (function): like `mount`, but nothing implicit (no `anonymous`, no endpoint,
  a clean environment whose proxy variables trap non-loopback requests in
  `auth_server.escapes`); fails the test at teardown if any request tried to leave loopback.

Nothing here skips: a missing prerequisite is a failure.
"""

from __future__ import annotations

import pytest

from firebase_fixture import FirebaseStorageServer
from gcs_emulator import GCSEmulator
from storefs_testlib import BUCKET, Corpus, ForbiddingProxy, MountManager, require_fuse, storefs_bin as _bin


@pytest.fixture(scope="session")
def emulator():
    emu = GCSEmulator()
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


@pytest.fixture(scope="session")
def corpus(emulator) -> Corpus:
    return emulator.corpus


@pytest.fixture(scope="session")
def storefs_bin() -> str:
    require_fuse()
    return _bin()


@pytest.fixture
def mount(emulator, storefs_bin):
    manager = MountManager(emulator.endpoint, storefs_bin)
    yield manager
    problems = manager.close()
    if problems:
        pytest.fail("mount cleanup: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def proxy(emulator):
    p = ForbiddingProxy(emulator.endpoint)
    p.start()
    yield p
    p.stop()


def _auth_fixture():
    """auth_fixture needs `cryptography`; only the tests that use it fail without it."""
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
    p = _auth_fixture().GCSAuthProxy(emulator.endpoint, auth_server)
    p.start()
    yield p
    p.stop()


@pytest.fixture
def bare_mount(storefs_bin, auth_server):
    manager = _auth_fixture().ExplicitMountManager(storefs_bin, trap=auth_server.endpoint)
    yield manager
    problems = manager.close()
    if auth_server.escapes:
        problems.append("storefs tried to leave loopback: " + ", ".join(auth_server.escapes))
    if problems:
        pytest.fail("bare_mount cleanup: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def fault_proxy(emulator):
    """A fault_proxy.FaultProxy in front of the emulator (no faults until a test adds rules or
    a random plan); stopped at teardown, which releases every socket it holds."""
    from fault_proxy import FaultProxy
    p = FaultProxy(emulator.endpoint)
    p.start()
    yield p
    p.stop()
