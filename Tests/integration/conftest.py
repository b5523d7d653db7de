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

Nothing here skips: a missing prerequisite is a failure.
"""

from __future__ import annotations

import pytest

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
