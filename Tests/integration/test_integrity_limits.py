"""What no checksum covers (docs/integrity.md, "What no checksum covers"; issue 49, item 7),
shown through a real mount over plain http and a proxy that corrupts answers:

- a bit flipped in a ranged answer of an object never read whole is served as it came;
- a 206 whose body is shifted under a correct Content-Range is served as it came;
- either is caught, and the object's bytes come back exact, once the object is read whole
  (its crc32c is checked when it completes in the cache).

The JSON API gives whole-object hashes only; over https TLS rejects such changes on the way,
so only a faulty server can send them. If storefs ever catches these cases, these tests fail
and the documents must say what changed. Objects live in `integrity-bucket`.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import re
from pathlib import Path

import pytest

from storefs_testlib import read_whole

IB = "integrity-bucket"
KiB, MiB = 1 << 10, 1 << 20
ROOT = Path(__file__).resolve().parents[2]
OFFSET, COUNT = 1 * MiB, 64 * KiB


@pytest.fixture(scope="module")
def ibucket(emulator) -> dict[str, bytes]:
    emulator.create_bucket(IB, exist_ok=True)
    rng = random.Random(7)
    data = {"flip/never-whole.bin": rng.randbytes(4 * MiB), "shift/never-whole.bin": rng.randbytes(4 * MiB)}
    for name, body in data.items():
        res = emulator.upload(IB, name, body)
        assert int(res["size"]) == len(body) and res.get("crc32c"), res
    return data


def direct_pread(path: str, n: int, offset: int) -> bytes:
    """One O_DIRECT pread: one FUSE read of exactly this range, no kernel readahead."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, n)
        got = os.preadv(fd, [buf], offset)
        return bytes(buf[:got])
    finally:
        os.close(fd)


@pytest.mark.parametrize("fault,params", [("bitflip", {"flips": 1, "seed": 3}), ("shifted_body", {"shift": 4096})],
                         ids=["bitflip", "shifted_body"])
def test_a_corrupt_ranged_answer_of_an_object_never_read_whole_is_served_until_the_object_is_read_whole(
        mount, fault_proxy, ibucket, fault, params):
    name = ("flip" if fault == "bitflip" else "shift") + "/never-whole.bin"
    data = ibucket[name]
    m = mount(IB, endpoint=fault_proxy.endpoint, options=["read_ahead=0", "whole_file=0", "log_level=debug"])
    assert os.stat(m.p(name)).st_size == len(data)
    fault_proxy.add_rule(kind="media", name_prefix=name, fault=fault, count=1, **params)
    got = direct_pread(m.p(name), COUNT, OFFSET)
    corrupted = fault_proxy.requests("media", fault=fault)
    honest = [r.note for r in corrupted if r.note and not r.note.startswith("flipped bits [")]
    assert corrupted and not honest, f"the fault did not corrupt the answer: {corrupted}"
    want = data[OFFSET:OFFSET + COUNT]
    assert len(got) == COUNT
    if fault == "bitflip":
        wrong = [i for i in range(COUNT) if got[i] != want[i]]
        assert len(wrong) == 1 and bin(got[wrong[0]] ^ want[wrong[0]]).count("1") == 1, \
            f"expected exactly one flipped bit served (no checksum covers a range), got {len(wrong)} wrong bytes"
    else:
        shift = params["shift"]
        assert got == data[OFFSET + shift:OFFSET + shift + COUNT], \
            "expected the shifted body served as it came (its Content-Range was right)"
    # Read whole, the object completes in the cache: its crc32c finds the bad range. The read
    # that completes it fails with EIO (bytes served before were wrong), the object is fetched
    # again, and every byte read after is exact.
    try:
        first = read_whole(m.p(name))
    except OSError as exc:
        assert exc.errno == errno.EIO, repr(exc)
    else:
        assert first == data, "the whole read after the corrupt range returned wrong bytes"
    assert read_whole(m.p(name)) == data
    assert direct_pread(m.p(name), COUNT, OFFSET) == want
    assert "crc32c mismatch" in m.stderr().lower() or "checksum" in m.stderr().lower(), m.stderr()[-3000:]


def _section(text: str, title: str) -> str:
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", text, re.S | re.M)
    return m.group(1) if m else ""


def test_the_documents_say_which_corruptions_no_checksum_covers_and_why():
    integrity = (ROOT / "docs" / "integrity.md").read_text()
    section = _section(integrity, "What no checksum covers")
    assert section, "docs/integrity.md has no section 'What no checksum covers'"
    for needed in ("bit flipped in a ranged answer", "never read whole", "shifted under a correct `Content-Range`",
                   "whole objects", "TLS", "server"):
        assert needed in section, f"docs/integrity.md, 'What no checksum covers', does not say {needed!r}"
    readme = (ROOT / "README.md").read_text()
    assert "shifted under a correct `Content-Range`" in readme and "TLS" in readme and \
        "hashes of whole objects only" in readme, "README's integrity lines do not name what no checksum covers"
