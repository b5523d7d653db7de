#!/usr/bin/env python3
"""A synthetic bucket server for scale tests and benchmarks: millions of objects, none stored.

fake-gcs-server needs minutes to answer one listing at 100,000 objects. This server computes
everything from the object's name instead: listings, metadata (size, generation, a real
md5Hash and crc32c) and the bytes themselves, so a bucket of 1,000,000 objects costs nothing
to "create" and every read can be checked (`ScaleServer.object_bytes(name)`).

It speaks the two protocols the way storefs uses them (docs/protocol.md; the requests are
the ones in Sources/StorageClient/GCS/GCSJSONStore.swift and Firebase/FirebaseV0Store.swift):

    GET /storage/v1/b/B                                 bucket resource
    GET /storage/v1/b/B/o?prefix=&delimiter=&pageToken=&maxResults=&fields=&startOffset=&endOffset=
                                                        objects.list (§5): `items` (full object
                                                        resources, trimmed by `fields=`),
                                                        `prefixes`, `nextPageToken`
    GET /storage/v1/b/B/o/NAME[?generation=G][&fields=] objects.get (§5)
    GET /storage/v1/b/B/o/NAME?alt=media                media, also at /download/storage/v1/...
                                                        (the `mediaLink` it hands out); Range →
                                                        206 + Content-Range, 416 at/past the end
                                                        (§5.3); `generation=` not current → 404
    GET /v0/b/B/o?prefix=&delimiter=/&pageToken=[&maxResults=]
                                                        v0 list (§2.4): items carry only name
                                                        and bucket; `prefixes` and `items` are
                                                        always present; the placeholder of the
                                                        listed prefix is not listed; a prefix
                                                        not empty and not ending in one '/' is
                                                        400, as on the service
    GET /v0/b/B/o/NAME                                  v0 metadata (§2.2)
    GET /v0/b/B/o/NAME?alt=media                        v0 media (§2.3), with x-goog-generation
    GET /_scale/counts, /_scale/reset, /_scale/shape    control (not counted): request counts as
                                                        JSON, zero them, the shape

Unknown buckets, objects and routes are 404 with a JSON error body; every other method is 405.

The namespace (all names in byte order; widths grow with the counts so that byte order is
numeric order):

    d000/f00000.bin ... d{dirs-1}/f{files-1}.bin        dirs × files
    deep/, deep/g0.bin .. g2.bin, deep/n1/, deep/n1/g0.bin, ..., deep/n1/n2/...
                                                        `nested` levels, each with a zero-byte
                                                        placeholder and three files (off by default)
    odd/...                                             a few names that need encoding (space,
                                                        +, %, #, ?, non-ASCII), `odd=True`
    wide/f000000.bin ... wide/f{wide-1}.bin             one wide directory (`wide`, default 0)

Sizes are 0..max_size bytes (4096 by default; about 1 in 61 objects, and every placeholder,
is empty) and the generation (positive, 16 digits) come from a hash of the name;
`updated`/`timeCreated` are one fixed time; metageneration is 1. An object's bytes are the
start of one of 1024 pseudo-random streams followed by a 4-byte tag from its name's hash
(see Namespace.attrs), so reads can be checked byte for byte (`object_bytes`): a read at a
wrong offset or of another object shows. md5Hash and crc32c are real (computed from
precomputed md5 mid-states and CRC tables in ~1 µs each). Page tokens are opaque (base64 of
the name to resume at) and valid with any prefix; maxResults counts items and prefixes
together, defaults to 1000 and is capped there, as on GCS.

Speed, so that the server is never what a benchmark measures: a small HTTP/1.1 keep-alive
server on asyncio (request line and headers split by hand) in a process of its own; JSON is
built with generated f-strings per `fields=` selection; after each full listing page the
worker has its `render_ahead` (2) helper processes render the next pages of that listing in
parallel, and keeps rendered pages in a cache (`page_cache_mb`, 384 MiB: a 1000-item page
with storefs's `fields=` is ~290 KB, so a benchmark's repeated runs over 1.1M objects are
answered from it). One worker
(`workers=1`) is the default on purpose: clients such as storefs spread one listing's pages
over several keep-alive connections, and with more workers a page rendered ahead by one is
rendered again by another (measured: a storefs `find` of 1M objects took the same time with
one worker and 25% less server CPU). `python3 scale_server.py --walk` measures the direct
listing walk (see `walk`).

API (used by tests and benchmarks):

    with ScaleServer(bucket="scale-bucket", dirs=100, files=10000, wide=0) as s:   # a child process
        s.endpoint, s.port, s.pid, s.bucket
        s.count(), s.names(), s.size_of(n), s.object_bytes(n), s.generation_of(n),
        s.md5_of(n), s.crc32c_of(n)                 # computed here, like the server does
        s.counts, s.reset_counts(), s.media_bytes   # requests answered, by kind (KINDS)
    walk(s.endpoint, s.bucket, prefix="", delimited=True, api="gcs")
        # -> {"objects", "prefixes", "pages", "seconds"}

CLI: `scale_server.py [--dirs 100] [--files 10000] [--wide N] [--nested N] [--odd]
[--max-size BYTES] [--bucket B] [--host 127.0.0.1] [--port 0] [--external-url URL]
[--workers 1] [--render-ahead 2] [--page-cache-mb 384] [--log FILE]` prints one line
`READY http://127.0.0.1:PORT` and serves until SIGTERM/SIGINT. `--walk [--runs 3] [--flat]
[--api gcs|firebase] [--full] [--fresh]` instead starts a server, walks it, prints pages/s
and objects/s per run and their median, and exits (without --fresh, walks after the first are
answered from the page cache).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import collections
import hashlib
import http.client
import json
import mmap
import os
import pickle
import random
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from array import array
from typing import Iterator

DEFAULT_BUCKET = "scale-bucket"
FIXED_TIME = "2024-05-06T07:08:09.123Z"
KINDS = ("list", "metadata", "media", "v0list", "v0metadata", "v0media", "other")
PAGE_MAX = 1000
# How listing pages were served: rendered for the request, rendered ahead by a helper, served
# from the page cache, waited for (a helper was rendering it): ScaleServer.page_stats().
PAGE_STATS = ("rendered", "ahead", "cached", "waited")
# What storefs asks for in a listing (GCSJSONStore.listFields): the default `fields=` of walk().
STOREFS_LIST_FIELDS = ("items(name,bucket,size,generation,metageneration,updated,timeCreated,"
                       "contentType,contentEncoding,cacheControl,md5Hash,crc32c,metadata),"
                       "prefixes,nextPageToken")
GEN_BASE = 1_600_000_000_000_000   # microsecond-timestamp-like, as GCS generations are
GEN_SPAN = 100_000_000_000_000
VARIANTS = 1024                    # content streams (see Namespace.attrs)
VARIANT_STRIDE = 256               # bytes between the starts of two streams in the buffer
BUFFER_SEED = 20240506
MAX_SIZE_LIMIT = 1 << 20           # object bodies are built in memory: keep them small


def _unquote(s: str, errors: str = "strict") -> str:
    return urllib.parse.unquote(s, errors=errors) if "%" in s else s


_unquote_plus = urllib.parse.unquote_plus
_md5 = hashlib.md5
_b64 = base64.b64encode


def quote_name(s: str) -> str:
    """storefs's one encoding rule (docs/protocol.md §1.3): every byte outside A-Z a-z 0-9
    - . _ ~ is %XX of its UTF-8."""
    return urllib.parse.quote(s, safe="")


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_NEEDS_ESCAPE = re.compile(r'[\x00-\x1f"\\\x7f\u2028\u2029]')


def json_str(s: str) -> str:
    """The inside of a JSON string literal for `s` (UTF-8 kept as is)."""
    if _NEEDS_ESCAPE.search(s) is None:
        return s
    return json.dumps(s, ensure_ascii=False)[1:-1]


def successor(p: str) -> str | None:
    """The smallest string greater than every string that starts with `p` (None: none)."""
    while p and p[-1] == "\U0010ffff":
        p = p[:-1]
    if not p:
        return None
    return p[:-1] + chr(ord(p[-1]) + 1)


def encode_token(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode("utf-8", "surrogatepass")).decode().rstrip("=")


def decode_token(token: str) -> str:
    """Raises ValueError for anything encode_token did not make."""
    if not token or len(token) > 8192:
        raise ValueError("bad token")
    raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    return raw.decode("utf-8", "surrogatepass")


# ============================================================================ CRC32C
class _Crc32c:
    """CRC32C (Castagnoli) of windows of one fixed buffer without touching their bytes.

    No stdlib module computes CRC32C and a bytewise Python loop costs ~400 µs per 4 KiB, so:
    prefix CRCs of the buffer (zero start state, no final xor) and byte tables for "run n
    zero bytes through the register" (linear, so 4 lookups per base-64 digit of n) give
        crc(buf[off:off+n]) = pre[off+n] ^ zeros(pre[off] ^ ~0, n) ^ ~0
    in ~1 µs.
    """

    POLY = 0x82F63B78

    def __init__(self, buf: bytes, max_len: int) -> None:
        t = []
        for b in range(256):
            c = b
            for _ in range(8):
                c = (c >> 1) ^ self.POLY if c & 1 else c >> 1
            t.append(c)
        self.table = t
        pre = array("I", bytes(4 * (len(buf) + 1)))
        s = 0
        k = 1
        for b in buf:
            s = t[(s ^ b) & 0xFF] ^ (s >> 8)
            pre[k] = s
            k += 1
        self.pre = pre
        self.levels: list[list[list[int] | None]] = []
        unit = [t[(1 << j) & 0xFF] ^ ((1 << j) >> 8) for j in range(32)]   # images of 1 zero byte
        while 64 ** len(self.levels) <= max(max_len, 64):
            tabs: list[list[int] | None] = [None]
            imgs = unit
            one = self._table(unit)
            for g in range(1, 64):
                tabs.append(self._table(imgs) if g > 1 else one)
                imgs = [self._apply(one, v) for v in imgs]
            self.levels.append(tabs)
            unit = imgs   # images of 64 × this level's unit: the next level's unit
        self.four = self.levels[0][4]   # 4 zero bytes: a 4-byte tail is four(state ^ le32(tail))

    @staticmethod
    def _table(imgs: list[int]) -> list[int]:
        f = [0] * 1024
        for q in range(4):
            for bit in range(8):
                e = imgs[8 * q + bit]
                lo = 1 << bit
                base = 256 * q
                for x in range(lo):
                    f[base + lo + x] = f[base + x] ^ e
        return f

    @staticmethod
    def _apply(f: list[int], v: int) -> int:
        return f[v & 255] ^ f[256 + ((v >> 8) & 255)] ^ f[512 + ((v >> 16) & 255)] ^ f[768 + (v >> 24)]

    def state(self, off: int, n: int) -> int:
        """The register (before the final xor) after buf[off:off+n], from the usual start ~0."""
        pre = self.pre
        v = pre[off] ^ 0xFFFFFFFF
        levels = self.levels
        d = 0
        m = n
        while m:
            g = m & 63
            if g:
                f = levels[d][g]
                v = f[v & 255] ^ f[256 + ((v >> 8) & 255)] ^ f[512 + ((v >> 16) & 255)] ^ f[768 + (v >> 24)]
            m >>= 6
            d += 1
        return pre[off + n] ^ v

    def bytes_crc(self, data: bytes) -> int:
        """Plain bytewise CRC32C (slow): for checks."""
        t = self.table
        c = 0xFFFFFFFF
        for b in data:
            c = t[(c ^ b) & 0xFF] ^ (c >> 8)
        return c ^ 0xFFFFFFFF


# ============================================================================ namespace
class _Numbered:
    """Names `head + zero-padded i + tail` for i in [0, count): byte order is numeric order."""

    def __init__(self, head: str, count: int, width: int, tail: str, content_type: str) -> None:
        width = max(width, len(str(max(count - 1, 0))))
        self.head, self.tail, self.width = head, tail, width
        self.count = count
        self.fmt = head.replace("%", "%%") + "%0" + str(width) + "d" + tail.replace("%", "%%")
        num = "%0" + str(width) + "d"
        self.jfmt = json_str(head).replace("%", "%%") + num + json_str(tail).replace("%", "%%")
        self.ufmt = quote_name(head).replace("%", "%%") + num + quote_name(tail).replace("%", "%%")
        self.placeholder = False
        self.jctype = json_str(content_type)
        self.first = self.name(0)
        self.last = self.name(count - 1)

    def name(self, i: int) -> str:
        return self.fmt % i

    def jname(self, i: int) -> str:
        return self.jfmt % i

    def uname(self, i: int) -> str:
        return self.ufmt % i

    def exact(self, name: str) -> int:
        """i when `name` is this family's name(i), else -1 (O(1))."""
        h, t, w = self.head, self.tail, self.width
        if len(name) != len(h) + w + len(t) or not name.startswith(h) or not name.endswith(t):
            return -1
        digits = name[len(h):len(h) + w]
        if not (digits.isascii() and digits.isdigit()):
            return -1
        i = int(digits)
        return i if i < self.count else -1

    def index(self, key: str) -> int:
        """The first i whose name is >= key (count if none)."""
        lo, hi = 0, self.count
        fmt = self.fmt
        while lo < hi:
            mid = (lo + hi) >> 1
            if fmt % mid < key:
                lo = mid + 1
            else:
                hi = mid
        return lo


class _Listed:
    """An explicit sorted list of names (placeholders, odd names)."""

    def __init__(self, names: list[str], content_type: str, placeholder: bool = False) -> None:
        self.names = sorted(names)
        assert len(set(self.names)) == len(self.names)
        self.count = len(self.names)
        self.jnames = [json_str(n) for n in self.names]
        self.unames = [quote_name(n) for n in self.names]
        self.placeholder = placeholder
        self.jctype = json_str(content_type)
        self.first, self.last = self.names[0], self.names[-1]

    def name(self, i: int) -> str:
        return self.names[i]

    def jname(self, i: int) -> str:
        return self.jnames[i]

    def uname(self, i: int) -> str:
        return self.unames[i]

    def index(self, key: str) -> int:
        return bisect.bisect_left(self.names, key)

    def exact(self, name: str) -> int:
        i = bisect.bisect_left(self.names, name)
        return i if i < self.count and self.names[i] == name else -1


ODD_NAMES = ["odd/with space.bin", "odd/a+b.bin", "odd/100%.bin", "odd/hash#tag.bin",
             "odd/what?.bin", "odd/ünïcødé-日本.bin", "odd/quote\"back\\slash.bin",
             "odd/sub dir/inner.bin", "odd/~tilde.bin"]


class Namespace:
    """The synthetic bucket: every name, its size, generation, bytes and checksums, and
    listings, all computed; pure functions of the constructor arguments."""

    def __init__(self, dirs: int = 100, files: int = 10000, wide: int = 0, nested: int = 0,
                 odd: bool = False, max_size: int = 4096) -> None:
        if min(dirs, files, wide, nested) < 0:
            raise ValueError("dirs, files, wide and nested must be >= 0")
        if not 0 <= max_size <= MAX_SIZE_LIMIT:
            raise ValueError(f"max_size must be 0..{MAX_SIZE_LIMIT}")
        self.dirs, self.files, self.wide, self.nested, self.odd = dirs, files, wide, nested, odd
        self.max_size = max_size
        fams: list = []
        if files > 0:
            dw = max(3, len(str(max(dirs - 1, 0))))
            for d in range(dirs):
                fams.append(_Numbered("d%0*d/f" % (dw, d), files, 5, ".bin", "application/octet-stream"))
        for k in range(nested):
            level = "deep/" + "".join(f"n{m}/" for m in range(1, k + 1))
            fams.append(_Listed([level], "application/x-directory", placeholder=True))
            fams.append(_Numbered(level + "g", 3, 1, ".bin", "application/octet-stream"))
        if odd:
            fams.append(_Listed(ODD_NAMES, "application/octet-stream"))
        if wide > 0:
            fams.append(_Numbered("wide/f", wide, 6, ".bin", "application/octet-stream"))
        fams = [f for f in fams if f.count > 0]
        fams.sort(key=lambda f: f.first)
        for a, b in zip(fams, fams[1:]):
            if not a.last < b.first:
                raise AssertionError(f"families overlap: {a.last!r} >= {b.first!r}")
        self.families = fams
        self.firsts = [f.first for f in fams]
        self.lasts = [f.last for f in fams]
        self._total = sum(f.count for f in fams)
        self._buf: bytes | None = None
        self._mv: memoryview | None = None
        self._crc: _Crc32c | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ names
    def count(self) -> int:
        return self._total

    def names(self) -> Iterator[str]:
        for f in self.families:
            name = f.name
            for i in range(f.count):
                yield name(i)

    def seek(self, key: str) -> tuple[int, int]:
        """(family, index) of the first name >= key; (len(families), 0) when there is none."""
        fi = bisect.bisect_left(self.lasts, key)
        if fi == len(self.families):
            return fi, 0
        f = self.families[fi]
        if key <= f.first:
            return fi, 0
        return fi, f.index(key)

    def find(self, name: str):
        """(family, index) of `name`, or None when the bucket has no such object."""
        fi = bisect.bisect_right(self.firsts, name) - 1
        if fi < 0:
            return None
        f = self.families[fi]
        i = f.exact(name)
        return (f, i) if i >= 0 else None

    def __contains__(self, name: str) -> bool:
        return self.find(name) is not None

    # ------------------------------------------------------------------ per-object values
    # An object's bytes are the first size-4 bytes of one of VARIANTS pseudo-random streams
    # (overlapping windows of one buffer, VARIANT_STRIDE apart) followed by a 4-byte tag from
    # the hash of its name (objects under 4 bytes: the tag's first bytes). So a read from a
    # wrong offset shows at once, a wrong object's tail always shows, and md5 and crc32c cost
    # about 1 µs whatever the size: md5 from a mid-state saved every `md5_stride` bytes of
    # each stream, crc32c from prefix CRCs (`_Crc32c`) and one 4-byte step for the tag.
    def attrs(self, name: str, placeholder: bool | None = None) -> tuple[int, int, int, bytes]:
        """(size, generation, stream offset, 4-byte tag) of an object, from a hash of its name."""
        d = _md5(name.encode("utf-8", "surrogatepass")).digest()
        h = int.from_bytes(d, "little")
        if placeholder is None:
            found = self.find(name)
            placeholder = found is not None and found[0].placeholder
        if placeholder or h % 61 == 0:
            size = 0
        else:
            size = (h >> 8) % (self.max_size + 1)
        return (size, GEN_BASE + (h >> 24) % GEN_SPAN, ((h >> 80) % VARIANTS) * VARIANT_STRIDE, d[12:])

    def size_of(self, name: str) -> int:
        return self.attrs(name)[0]

    def generation_of(self, name: str) -> int:
        return self.attrs(name)[1]

    def _prepare(self) -> None:
        """The stream buffer, md5 mid-states and CRC tables (~0.1 s, once; thread-safe)."""
        if self._mv is not None:
            return
        with self._lock:
            if self._mv is not None:
                return
            buf = random.Random(BUFFER_SEED).randbytes(VARIANT_STRIDE * (VARIANTS - 1) + self.max_size)
            mv = memoryview(buf)
            stride = 64 * max(1, -(-self.max_size // (64 * 64)))
            states = []
            for v in range(VARIANTS):
                o = v * VARIANT_STRIDE
                h = _md5()
                row = [h.copy()]
                for j in range(0, self.max_size - stride + 1, stride):
                    h.update(mv[o + j:o + j + stride])
                    row.append(h.copy())
                states.append(row)
            self._crc = _Crc32c(buf, self.max_size)
            self._crc_b64 = self._make_crc_b64(self._crc)
            self.md5_stride = stride
            self._states = states
            self._buf = buf
            self._mv = mv

    def crc_engine(self) -> _Crc32c:
        self._prepare()
        return self._crc

    def content(self, size: int, o: int, tag: bytes) -> bytes:
        if size < 4:
            return tag[:size]
        self._prepare()
        return self._mv[o:o + size - 4].tobytes() + tag

    def object_bytes(self, name: str) -> bytes:
        size, _, o, tag = self.attrs(name)
        return self.content(size, o, tag)

    def md5_b64(self, size: int, o: int, tag: bytes) -> str:
        if size < 4:
            return _b64(_md5(tag[:size]).digest()).decode()
        if self._mv is None:
            self._prepare()
        m = size - 4
        s = self.md5_stride
        j = m // s
        h = self._states[o // VARIANT_STRIDE][j].copy()
        if m > j * s:
            h.update(self._mv[o + j * s:o + m])
        h.update(tag)
        return _b64(h.digest()).decode()

    def crc_b64(self, size: int, o: int, tag: bytes) -> str:
        if self._mv is None:
            self._prepare()
        return self._crc_b64(size, o, tag)

    def _make_crc_b64(self, c: _Crc32c):
        """crc_b64 with everything bound locally. With max_size <= 8 KiB, the register after
        each stream's first 64·j bytes is kept (xor pre[o + 64·j], ready for one step), so a
        CRC is two 4-lookup table steps; larger objects take Crc32c.state."""
        pre, four, state, slow = c.pre, c.four, c.state, c.bytes_crc
        level0 = c.levels[0]
        b64pairs = [a + b for a in _B64 for b in _B64]
        fast = self.max_size <= 8192
        per = self.max_size // 64 + 1
        q: list[int] = []
        if fast:
            step64 = c.levels[1][1]
            for v in range(VARIANTS):
                o = v * VARIANT_STRIDE
                s = 0xFFFFFFFF
                for j in range(per):
                    q.append(s ^ pre[o + 64 * j])
                    if j + 1 < per:
                        x = s ^ pre[o + 64 * j]
                        s = (step64[x & 255] ^ step64[256 + ((x >> 8) & 255)] ^ step64[512 + ((x >> 16) & 255)]
                             ^ step64[768 + (x >> 24)] ^ pre[o + 64 * (j + 1)])

        def crc_b64(size: int, o: int, tag: bytes) -> str:
            if size < 4:
                v = slow(tag[:size])
            else:
                m = size - 4
                if fast:
                    v = q[(o // VARIANT_STRIDE) * per + (m >> 6)]
                    r = m & 63
                    if r:
                        f = level0[r]
                        v = (f[v & 255] ^ f[256 + ((v >> 8) & 255)] ^ f[512 + ((v >> 16) & 255)]
                             ^ f[768 + (v >> 24)])
                    v ^= pre[o + m]
                else:
                    v = state(o, m)
                v ^= int.from_bytes(tag, "little")
                v = (four[v & 255] ^ four[256 + ((v >> 8) & 255)] ^ four[512 + ((v >> 16) & 255)]
                     ^ four[768 + (v >> 24)] ^ 0xFFFFFFFF)
            x = v << 4   # 32 bits + 4 zero bits = 6 base64 digits, then "=="
            return b64pairs[x >> 24] + b64pairs[(x >> 12) & 4095] + b64pairs[x & 4095] + "=="

        return crc_b64

    def md5_of(self, name: str) -> str:
        """md5Hash as the resources give it (base64 of the digest)."""
        size, _, o, tag = self.attrs(name)
        return self.md5_b64(size, o, tag)

    def crc32c_of(self, name: str) -> str:
        """crc32c as the resources give it (base64 of the big-endian uint32)."""
        size, _, o, tag = self.attrs(name)
        return self.crc_b64(size, o, tag)

    # ------------------------------------------------------------------ listing
    def list_page(self, prefix: str, delimiter: str | None, start: str, limit: int,
                  end: str | None = None, hide: str | None = None):
        """One page: (items as [(family, index)], prefixes, resume key or None).

        Entries are the names >= start that begin with `prefix` (and are < end), in byte
        order; with a delimiter, a name with the delimiter after the prefix becomes the prefix
        up to it (once; its subtree is skipped). `limit` counts items and prefixes; `hide`
        (a name) is skipped without counting. The resume key is where the next page starts:
        a name that follows the last entry's subtree (or the entry itself)."""
        fams = self.families
        nf = len(fams)
        items: list = []
        prefixes: list[str] = []
        fi, i = self.seek(start)
        n = 0
        lp = len(prefix)
        resume = None
        while fi < nf:
            f = fams[fi]
            name = f.name(i)
            if not name.startswith(prefix) or (end is not None and name >= end):
                return items, prefixes, None
            if delimiter:
                k = name.find(delimiter, lp)
                if k >= 0:
                    if n == limit:
                        return items, prefixes, resume
                    p = name[:k + len(delimiter)]
                    prefixes.append(p)
                    n += 1
                    resume = successor(p)
                    if resume is None:
                        return items, prefixes, None
                    fi, i = self.seek(resume)
                    continue
            if name != hide:
                if n == limit:
                    return items, prefixes, resume
                items.append((f, i))
                n += 1
                resume = name + "\x00"
            i += 1
            if i == f.count:
                fi += 1
                i = 0
        return items, prefixes, None


# ============================================================================ rendering
GCS_OBJECT_FIELDS = [
    # (field, f-string fragment of its JSON value); names known per item: jn (JSON-escaped
    # name), un (URL-encoded name), ct (JSON content type), size, gen, o, tag (Namespace.attrs).
    ("kind", '"storage#object"'),
    ("id", '"{JB}/{jn}/{gen}"'),
    ("selfLink", '"{X}/storage/v1/b/{UB}/o/{un}"'),
    ("mediaLink", '"{X}/download/storage/v1/b/{UB}/o/{un}?generation={gen}&alt=media"'),
    ("name", '"{jn}"'),
    ("bucket", '"{JB}"'),
    ("generation", '"{gen}"'),
    ("metageneration", '"1"'),
    ("contentType", '"{ct}"'),
    ("storageClass", '"STANDARD"'),
    ("size", '"{size}"'),
    ("md5Hash", '"{md5(size, o, tag)}"'),
    ("crc32c", '"{crc(size, o, tag)}"'),
    ("etag", '"{etag(gen)}"'),
    ("timeCreated", '"{T}"'),
    ("updated", '"{T}"'),
    ("timeStorageClassUpdated", '"{T}"'),
]

V0_OBJECT_FIELDS = [
    ("name", '"{jn}"'),
    ("bucket", '"{JB}"'),
    ("generation", '"{gen}"'),
    ("metageneration", '"1"'),
    ("contentType", '"{ct}"'),
    ("timeCreated", '"{T}"'),
    ("updated", '"{T}"'),
    ("storageClass", '"STANDARD"'),
    ("size", '"{size}"'),
    ("md5Hash", '"{md5(size, o, tag)}"'),
    ("contentEncoding", '"identity"'),
    ("contentDisposition", '"inline; filename*=utf-8\'\'{disposition(un)}"'),
    ("crc32c", '"{crc(size, o, tag)}"'),
    ("etag", '"{etag(gen)}"'),
    ("downloadTokens", '"{token(jn)}"'),
]


def _literal(text: str) -> str:
    """`text` as literal f-string source (inside '...')."""
    return (text.replace("\\", "\\\\").replace("'", "\\'").replace("{", "{{").replace("}", "}}")
            .replace("\n", "\\n").replace("\r", "\\r"))


def etag_of(gen: int, metageneration: int = 1) -> str:
    """GCS-style etag: base64 of the protobuf varints (1: generation, 2: metageneration)."""
    out = bytearray(b"\x08")
    v = gen
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    out += b"\x10" + bytes([metageneration])
    return _b64(bytes(out)).decode()


def download_token(jname: str) -> str:
    d = _md5(b"token:" + jname.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{d[:8]}-{d[8:12]}-4{d[13:16]}-a{d[17:20]}-{d[20:32]}"


def parse_fields(spec: str) -> dict:
    """A `fields=` selection as {field: None (all of it) or a nested selection}. Understands
    `a,b(c,d),e/f` and nesting; raises ValueError on unbalanced parentheses."""
    pos = 0
    n = len(spec)

    def add(out: dict, path: str, sub) -> None:
        if not path:
            raise ValueError("empty field name")
        parts = path.split("/")
        for p in parts[:-1]:
            cur = out.get(p, {})
            if cur is None:
                return          # already selected whole
            out[p] = cur
            out = cur
        last = parts[-1]
        if sub is None or out.get(last, {}) is None:
            out[last] = None
        else:
            out.setdefault(last, {}).update(sub)

    def parse_list(depth: int) -> dict:
        nonlocal pos
        out: dict = {}
        while True:
            start = pos
            while pos < n and spec[pos] not in ",()":
                pos += 1
            path = spec[start:pos].strip()
            if pos < n and spec[pos] == "(":
                pos += 1
                sub = parse_list(depth + 1)
                if pos >= n or spec[pos] != ")":
                    raise ValueError("unbalanced parentheses")
                pos += 1
                add(out, path, sub)
            elif path:
                add(out, path, None)
            if pos >= n:
                if depth:
                    raise ValueError("unbalanced parentheses")
                return out
            c = spec[pos]
            if c == ",":
                pos += 1
            elif c == ")":
                if not depth:
                    raise ValueError("unbalanced parentheses")
                return out
            else:
                raise ValueError(f"unexpected {c!r}")

    def star(sel):   # `*` selects everything at its level
        if sel is None or "*" in sel:
            return None
        return {k: star(v) for k, v in sel.items()}

    return star(parse_list(0))


class Renderer:
    """JSON for one server: item renderers generated per field selection (f-strings), cached."""

    def __init__(self, ns: Namespace, bucket: str, external: str) -> None:
        self.ns = ns
        self.bucket = bucket
        self.external = external.rstrip("/")
        self.consts = {"JB": json_str(bucket), "UB": quote_name(bucket), "X": json_str(self.external),
                       "T": FIXED_TIME}
        self._cache: dict = {}

    def object_renderer(self, table, selection):
        """A function (jn, un, ct, size, gen, o, tag) -> JSON object text, for the fields of
        `table` that `selection` (None: all) picks."""
        key = (id(table), _freeze(selection))
        fn = self._cache.get(key)
        if fn is not None:
            return fn
        parts = []
        for field, value in table:
            if selection is not None and field not in selection:
                continue
            for k, v in self.consts.items():
                value = value.replace("{" + k + "}", "\x00" + k + "\x00")
            # Split into literal text and {expressions}; constants go in as literal text.
            src = ""
            for piece in re.split(r"(\{[^{}]*\}|\x00[A-Z]+\x00)", value):
                if piece.startswith("{"):
                    src += piece
                elif piece.startswith("\x00"):
                    src += _literal(self.consts[piece.strip("\x00")])
                else:
                    src += _literal(piece)
            parts.append(_literal(json.dumps(field)) + ":" + src)
        body = "{{" + ",".join(parts) + "}}"
        code = f"def render(jn, un, ct, size, gen, o, tag):\n    return f'{body}'\n"
        self.ns._prepare()
        env = {"md5": self.ns.md5_b64, "crc": self.ns._crc_b64, "etag": etag_of,
               "disposition": lambda un: quote_name(_unquote(un).rsplit("/", 1)[-1]),
               "token": download_token}
        exec(code, env)   # noqa: S102 - our own template text
        fn = env["render"]
        self._cache[key] = fn
        return fn

    def gcs_items(self, entries, selection) -> str:
        render = self.object_renderer(GCS_OBJECT_FIELDS, selection)
        attrs = self.ns.attrs
        out = []
        for f, i in entries:
            jn = f.jname(i)
            size, gen, o, tag = attrs(f.name(i), f.placeholder)
            out.append(render(jn, f.uname(i), f.jctype, size, gen, o, tag))
        return ",".join(out)

    def gcs_list(self, entries, prefixes, token, selection) -> str:
        parts = []
        sel = selection
        if sel is None or "kind" in sel:
            parts.append('"kind":"storage#objects"')
        if token is not None and (sel is None or "nextPageToken" in sel):
            parts.append(f'"nextPageToken":"{token}"')
        if prefixes and (sel is None or "prefixes" in sel):
            parts.append('"prefixes":[' + ",".join('"' + json_str(p) + '"' for p in prefixes) + "]")
        if entries and (sel is None or "items" in sel):
            parts.append('"items":[' + self.gcs_items(entries, None if sel is None else sel["items"]) + "]")
        return "{" + ",".join(parts) + "}"

    def v0_list(self, entries, prefixes, token) -> str:
        jb = self.consts["JB"]
        items = ",".join(f'{{"name":"{f.jname(i)}","bucket":"{jb}"}}' for f, i in entries)
        out = ('{"prefixes":[' + ",".join('"' + json_str(p) + '"' for p in prefixes)
               + '],"items":[' + items + "]")
        if token is not None:
            out += f',"nextPageToken":"{token}"'
        return out + "}"

    def gcs_object(self, f, i, selection, attrs=None) -> str:
        return self.object_renderer(GCS_OBJECT_FIELDS, selection)(
            f.jname(i), f.uname(i), f.jctype, *(attrs or self.ns.attrs(f.name(i), f.placeholder)))

    def v0_object(self, f, i, attrs=None) -> str:
        return self.object_renderer(V0_OBJECT_FIELDS, None)(
            f.jname(i), f.uname(i), f.jctype, *(attrs or self.ns.attrs(f.name(i), f.placeholder)))

    def bucket_resource(self) -> str:
        c = self.consts
        return (f'{{"kind":"storage#bucket","selfLink":"{c["X"]}/storage/v1/b/{c["UB"]}",'
                f'"id":"{c["JB"]}","name":"{c["JB"]}","projectNumber":"123456789012",'
                f'"metageneration":"1","location":"US","storageClass":"STANDARD","etag":"CAE=",'
                f'"timeCreated":"{FIXED_TIME}","updated":"{FIXED_TIME}","locationType":"multi-region",'
                f'"rpo":"DEFAULT"}}')


def _freeze(sel):
    if sel is None:
        return None
    return tuple(sorted((k, _freeze(v)) for k, v in sel.items()))


# ============================================================================ counters
class SharedCounts:
    """Request counts in shared memory: one row per worker process (single writer each, no
    locks), plus a baseline row that reset() sets to the current sums. Slots: KINDS, then
    media body bytes."""

    SLOTS = len(KINDS) + 1 + len(PAGE_STATS)

    def __init__(self, workers: int, path: str | None = None, create: bool = False) -> None:
        self.workers = workers
        size = 8 * self.SLOTS * (workers + 1)
        if path is None:
            self.mm = mmap.mmap(-1, size)
        else:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
            try:
                if create or os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                self.mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self.q = memoryview(self.mm).cast("Q")
        self.row = 1   # this process's row (workers: 1..workers)

    def add(self, slot: int, n: int = 1) -> None:
        k = self.row * self.SLOTS + slot
        self.q[k] += n

    def sums(self) -> list[int]:
        q, s = self.q, self.SLOTS
        return [sum(q[r * s + k] for r in range(1, self.workers + 1)) - q[k] for k in range(s)]

    def counter(self) -> collections.Counter:
        sums = self.sums()
        return collections.Counter({k: v for k, v in zip(KINDS, sums) if v})

    def media_bytes(self) -> int:
        return self.sums()[len(KINDS)]

    def page_stats(self) -> dict:
        sums = self.sums()
        return {k: sums[_SLOT[k]] for k in PAGE_STATS}

    def reset(self) -> None:
        q, s = self.q, self.SLOTS
        for k in range(s):
            q[k] = sum(q[r * s + k] for r in range(1, self.workers + 1))

    def close(self) -> None:
        try:
            self.q.release()
            self.mm.close()
        except (BufferError, ValueError):
            pass


_SLOT = {k: n for n, k in enumerate(KINDS + ("media_bytes",) + PAGE_STATS)}


# ============================================================================ HTTP app
class HTTPError(Exception):
    def __init__(self, status: int, body: str, headers=()) -> None:
        super().__init__(status)
        self.status, self.body, self.headers = status, body, list(headers)


def gcs_error(status: int, message: str, reason: str) -> HTTPError:
    m = json.dumps(message, ensure_ascii=False)
    return HTTPError(status, f'{{"error":{{"code":{status},"message":{m},"errors":[{{"message":{m},'
                             f'"domain":"global","reason":"{reason}"}}]}}}}')


def v0_error(status: int, message: str) -> HTTPError:
    return HTTPError(status, f'{{"error":{{"code":{status},"message":{json.dumps(message)}}}}}')


V0_BAD_PREFIX = "The prefix parameter is required to be empty or ends with a single / character."
REASONS = {200: "OK", 206: "Partial Content", 400: "Bad Request", 404: "Not Found",
           405: "Method Not Allowed", 412: "Precondition Failed", 416: "Range Not Satisfiable",
           431: "Request Header Fields Too Large", 500: "Internal Server Error",
           501: "Not Implemented"}
JSON_TYPE = b"application/json; charset=UTF-8"


class App:
    """Routes one request to its answer: (status, [(header, value)], body bytes, kind)."""

    def __init__(self, ns: Namespace, bucket: str, external: str, counts: SharedCounts,
                 page_cache_bytes: int = 384 << 20, render_ahead: int = 0,
                 log_path: str | None = None) -> None:
        self.ns = ns
        self.bucket = bucket
        self.render = Renderer(ns, bucket, external)
        self.counts = counts
        self.pages: dict = {}
        self.page_bytes = 0
        self._rng = random.Random(1)
        self.page_cache_limit = page_cache_bytes
        self.next_starts: collections.OrderedDict = collections.OrderedDict()
        self.selections: dict = {}
        self.log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if log_path else None
        # Pages rendered ahead wait in the page cache: without one there is no rendering ahead.
        self.ahead: RenderAhead | None = (RenderAhead(self, render_ahead)
                                          if render_ahead > 0 and page_cache_bytes > 0 else None)

    # ------------------------------------------------------------------ page cache
    # Rendered listing pages as (body, resume key), by (chain, start): the chain is every
    # listing parameter but the page token, the start the name the page begins at.
    def _cache_get(self, key):
        return self.pages.get(key)

    def _cache_put(self, key, entry) -> None:
        """Evicts at random when full: walks repeat in loops, and an LRU cache smaller than
        the loop would evict exactly the page needed next; random eviction still answers
        about capacity/loop of them."""
        self.remember_next(key, entry[1])
        body = entry[0]
        if len(body) > self.page_cache_limit or key in self.pages:
            return
        pages = self.pages
        while pages and self.page_bytes + len(body) > self.page_cache_limit:
            victim = self._rng.choice(list(pages))
            self.page_bytes -= len(pages.pop(victim)[0])
        pages[key] = entry
        self.page_bytes += len(body)

    def remember_next(self, key, resume) -> None:
        nxt = self.next_starts
        nxt[key] = resume
        if len(nxt) > 20000:
            for _ in range(10000):
                nxt.popitem(last=False)

    def next_start(self, chain, start):
        """Where the page after the one at `start` begins (None: it is the last): from what
        was rendered, else from the listing alone (cheap, no rendering)."""
        key = (chain, start)
        if key in self.next_starts:
            return self.next_starts[key]
        api, prefix, delimiter, limit, _fields, end = chain
        resume = self.ns.list_page(prefix, delimiter, start, limit, end,
                                   hide=(prefix or None) if api == "v0" else None)[2]
        self.remember_next(key, resume)
        return resume

    # ------------------------------------------------------------------ dispatch
    @staticmethod
    def route(path: str, query: str):
        """(kind, api, route, encoded bucket, object tail) of a request path; kind is one of
        KINDS, or None for the control routes."""
        if path.startswith("/storage/v1/b/"):
            api, rest = "gcs", path[14:]
        elif path.startswith("/download/storage/v1/b/"):
            api, rest = "download", path[23:]
        elif path.startswith("/v0/b/"):
            api, rest = "v0", path[6:]
        elif path.startswith("/_scale/"):
            return None, "control", path[8:], "", ""
        else:
            return "other", None, None, "", ""
        benc, _, tail = rest.partition("/")
        if tail == "" and api == "gcs":
            return "other", api, "bucket", benc, ""
        if tail in ("o", "o/") and api != "download":
            return ("list" if api == "gcs" else "v0list"), api, "list", benc, ""
        if tail.startswith("o/") and len(tail) > 2:
            media = api == "download" or re.search(r"(?:^|&)alt=media(?:&|$)", query) is not None
            kind = ("v0" if api == "v0" else "") + ("media" if media else "metadata")
            return kind, api, "object", benc, tail[2:]
        return "other", api, None, benc, ""

    def handle(self, method: bytes, target: bytes, headers: dict):
        """((status, [(header, value)], body), kind) for one request."""
        path, _, query = target.decode("latin-1").partition("?")
        if path.startswith(("http://", "https://")):      # absolute-form target
            path = "/" + path.split("/", 3)[3] if path.count("/") >= 3 else "/"
        kind, api, route, benc, tail = self.route(path, query)
        if kind is None:
            return self.control(route), None
        self.counts.add(_SLOT[kind])
        if self.log_fd is not None:
            rng = headers.get(b"range")
            os.write(self.log_fd, b"%d %s %s %s%s\n" % (os.getpid(), kind.encode(), method, target,
                                                       b" range=" + rng if rng else b""))
        v0 = api == "v0"
        try:
            if method not in (b"GET", b"HEAD"):
                raise (v0_error(405, "Method not allowed.") if v0 else
                       gcs_error(405, "scale_server is read-only", "methodNotAllowed"))
            if route is None:
                raise v0_error(404, "Not Found.") if v0 else gcs_error(404, "Not Found", "notFound")
            params = self.params(query)
            if _unquote(benc, errors="strict") != self.bucket:
                raise (v0_error(404, "Not Found.") if v0 else
                       gcs_error(404, "The specified bucket does not exist.", "notFound"))
            if route == "bucket":
                return self.json(200, self.render.bucket_resource()), kind
            if route == "list":
                return (self.v0_list(params) if v0 else self.gcs_list(params)), kind
            name = _unquote(tail, errors="strict")   # a path: '+' stays '+'
            if kind == "metadata":
                return self.gcs_metadata(name, params), kind
            if kind == "v0metadata":
                return self.v0_metadata(name), kind
            return self.media(name, params, headers, v0), kind
        except HTTPError as e:
            return (e.status, [(b"Content-Type", JSON_TYPE)] + e.headers, e.body.encode()), kind
        except ValueError as e:   # a name or query value that is not UTF-8
            err = (v0_error(400, "Invalid request.") if v0 else
                   gcs_error(400, f"Invalid request: {e}", "invalid"))
            return (400, [(b"Content-Type", JSON_TYPE)], err.body.encode()), kind

    @staticmethod
    def params(query: str) -> dict:
        out: dict = {}
        if not query:
            return out
        for part in query.split("&"):
            if not part:
                continue
            k, _, v = part.partition("=")
            # '+' in a query is a space (docs/protocol.md §1.3); invalid UTF-8 is an error.
            out.setdefault(_unquote_plus(k, errors="strict"), _unquote_plus(v, errors="strict"))
        return out

    @staticmethod
    def json(status: int, text: str):
        return status, [(b"Content-Type", JSON_TYPE)], text.encode()

    @staticmethod
    def json_bytes(body: bytes):
        return 200, [(b"Content-Type", JSON_TYPE)], body

    def control(self, what: str):
        if what == "counts":
            c = self.counts.counter()
            return self.json(200, json.dumps({"counts": dict(c), "media_bytes": self.counts.media_bytes(),
                                              "pages": self.counts.page_stats()}))
        if what == "reset":
            self.counts.reset()
            return self.json(200, "{}")
        if what == "shape":
            ns = self.ns
            return self.json(200, json.dumps({"bucket": self.bucket, "dirs": ns.dirs, "files": ns.files,
                                              "wide": ns.wide, "nested": ns.nested, "odd": ns.odd,
                                              "max_size": ns.max_size, "count": ns.count()}))
        return 404, [(b"Content-Type", JSON_TYPE)], b'{"error":{"code":404,"message":"Not Found"}}'

    # ------------------------------------------------------------------ listings
    @staticmethod
    def _max_results(params: dict, v0: bool) -> int:
        raw = params.get("maxResults")
        if raw is None or raw == "":
            return PAGE_MAX
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise (v0_error(400, "Invalid maxResults") if v0 else
                   gcs_error(400, f"Invalid value for maxResults: {raw}", "invalid"))
        return min(n, PAGE_MAX)

    def _start(self, prefix: str, params: dict, v0: bool) -> str:
        start = prefix
        so = params.get("startOffset")
        if so and so > start:
            start = so
        token = params.get("pageToken")
        if token:
            try:
                key = decode_token(token)
            except (ValueError, UnicodeDecodeError):
                raise (v0_error(400, "Invalid page token") if v0 else
                       gcs_error(400, "Invalid page token", "invalid")) from None
            if key > start:
                start = key
        return start

    def _selection(self, fields):
        sel = self.selections.get(fields, False)
        if sel is False:
            try:
                sel = parse_fields(fields) if fields else None
            except ValueError:
                raise gcs_error(400, f"Invalid field selection {fields}", "invalidParameter") from None
            if len(self.selections) > 1000:
                self.selections.clear()
            self.selections[fields] = sel
        return sel

    def gcs_list(self, params: dict):
        prefix = params.get("prefix", "")
        fields = params.get("fields") or None
        self._selection(fields)   # a bad selection is a 400 before anything else
        chain = ("gcs", prefix, params.get("delimiter") or None, self._max_results(params, False), fields,
                 params.get("endOffset") or None)
        return self.json_bytes(self.serve_list(chain, self._start(prefix, params, False)))

    def v0_list(self, params: dict):
        prefix = params.get("prefix", "")
        if prefix and (not prefix.endswith("/") or prefix.endswith("//")):
            # As the Firebase service and its emulator answer (firebase_fixture.py does too).
            raise v0_error(400, V0_BAD_PREFIX)
        chain = ("v0", prefix, params.get("delimiter") or None, self._max_results(params, True), None, None)
        return self.json_bytes(self.serve_list(chain, self._start(prefix, params, True)))

    def render_page(self, chain, start):
        """(body, resume key or None) of the page of `chain` that begins at `start`."""
        api, prefix, delimiter, limit, fields, end = chain
        if api == "gcs":
            entries, prefixes, resume = self.ns.list_page(prefix, delimiter, start, limit, end)
            token = encode_token(resume) if resume is not None else None
            body = self.render.gcs_list(entries, prefixes, token, self._selection(fields))
        else:
            # The placeholder of the listed directory itself is not listed (§2.4).
            entries, prefixes, resume = self.ns.list_page(prefix, delimiter, start, limit, end,
                                                          hide=prefix or None)
            token = encode_token(resume) if resume is not None else None
            body = self.render.v0_list(entries, prefixes, token)
        return body.encode(), resume

    def serve_list(self, chain, start) -> bytes:
        key = (chain, start)
        entry = self._cache_get(key)
        ahead = self.ahead
        if entry is None and ahead is not None and ahead.in_flight(key):
            self.counts.add(_SLOT["waited"])
            ahead.wait(key)   # a helper is rendering it: do not render it twice
            entry = self._cache_get(key)
        if entry is None:
            self.counts.add(_SLOT["rendered"])
            entry = self.render_page(chain, start)
            self._cache_put(key, entry)
        else:
            self.counts.add(_SLOT["cached"])
        if entry[1] is not None and chain[3] >= 100 and ahead is not None:
            ahead.want(chain, entry[1])
        return entry[0]

    # ------------------------------------------------------------------ objects
    def _object(self, name: str, params: dict, v0: bool):
        found = self.ns.find(name) if name else None
        if found is None:
            if v0:
                raise v0_error(404, "Not Found.")
            raise gcs_error(404, f"No such object: {self.bucket}/{name}", "notFound")
        f, i = found
        size, gen, o, tag = self.ns.attrs(name, f.placeholder)
        if not v0:
            want = params.get("generation")
            if want is not None and want != str(gen):
                raise gcs_error(404, f"No such object: {self.bucket}/{name}", "notFound")
            for p, ok in (("ifGenerationMatch", lambda v: v == str(gen)),
                          ("ifGenerationNotMatch", lambda v: v != str(gen)),
                          ("ifMetagenerationMatch", lambda v: v == "1"),
                          ("ifMetagenerationNotMatch", lambda v: v != "1")):
                if p in params and not ok(params[p]):
                    raise gcs_error(412, "At least one of the pre-conditions you specified did not hold.",
                                    "conditionNotMet")
        return f, i, size, gen, o, tag

    def gcs_metadata(self, name: str, params: dict):
        f, i, *attrs = self._object(name, params, False)
        fields = params.get("fields")
        try:
            selection = parse_fields(fields) if fields else None
        except ValueError:
            raise gcs_error(400, f"Invalid field selection {fields}", "invalidParameter") from None
        return self.json(200, self.render.gcs_object(f, i, selection, attrs))

    def v0_metadata(self, name: str):
        f, i, *attrs = self._object(name, {}, True)
        return self.json(200, self.render.v0_object(f, i, attrs))

    def media(self, name: str, params: dict, headers: dict, v0: bool):
        f, i, size, gen, o, tag = self._object(name, params, v0)
        md5 = self.ns.md5_b64(size, o, tag)
        crc = self.ns.crc_b64(size, o, tag)
        h = [(b"Content-Type", f.jctype.encode()),
             (b"ETag", etag_of(gen).encode()),
             (b"Last-Modified", b"Mon, 06 May 2024 07:08:09 GMT"),
             (b"Accept-Ranges", b"bytes"),
             (b"Cache-Control", b"no-cache, no-store, max-age=0, must-revalidate"),
             (b"x-goog-generation", str(gen).encode()),
             (b"x-goog-metageneration", b"1"),
             (b"x-goog-hash", f"crc32c={crc},md5={md5}".encode()),
             (b"x-goog-stored-content-length", str(size).encode()),
             (b"x-goog-stored-content-encoding", b"identity"),
             (b"x-goog-storage-class", b"STANDARD")]
        if v0:
            base = name.rsplit("/", 1)[-1]
            h.append((b"Content-Disposition", ("inline; filename*=utf-8''" + quote_name(base)).encode()))
        rng = headers.get(b"range")
        if rng is not None:
            r = parse_range(rng, size)
            if r == "unsatisfiable":
                err = (v0_error(416, "Requested range not satisfiable.") if v0 else
                       gcs_error(416, "The requested range cannot be satisfied.",
                                 "requestedRangeNotSatisfiable"))
                return (416, [(b"Content-Type", JSON_TYPE), (b"Content-Range", f"bytes */{size}".encode())],
                        err.body.encode())
            if r is not None:
                a, b = r
                self.counts.add(len(KINDS), b - a + 1)
                h.append((b"Content-Range", f"bytes {a}-{b}/{size}".encode()))
                return 206, h, self.ns.content(size, o, tag)[a:b + 1]
        self.counts.add(len(KINDS), size)
        return 200, h, self.ns.content(size, o, tag)


def parse_range(value: bytes, size: int):
    """A single `bytes=` range → (first, last) clipped to the object; "unsatisfiable" when it
    starts at or past the end; None (serve the whole object) when it cannot be parsed or
    names several ranges."""
    try:
        text = value.decode("latin-1").strip()
    except UnicodeDecodeError:
        return None
    if not text.lower().startswith("bytes=") or "," in text:
        return None
    spec = text[6:].strip()
    first, dash, last = spec.partition("-")
    if not dash:
        return None
    first, last = first.strip(), last.strip()
    if not (first.isdigit() or first == "") or not (last.isdigit() or last == ""):
        return None
    if first == "":
        if last == "":
            return None
        n = int(last)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    a = int(first)
    if last != "" and int(last) < a:
        return None
    if a >= size:
        return "unsatisfiable"
    b = size - 1 if last == "" else min(int(last), size - 1)
    return a, b


# ============================================================================ render ahead
class RenderAhead:
    """Helper processes that render the next pages of a listing while the client reads this
    one. A worker serves; after it answers a page with a next page, `want` makes sure the
    next `n` pages are cached or being rendered by an idle helper (one page each), so n
    helpers render n pages at once. A request for a page a helper is rendering waits for it;
    anything else the worker renders itself. Helpers are forked on first use (closing every
    descriptor but their socket) and die with the worker."""

    def __init__(self, app: "App", n: int) -> None:
        self.app = app
        self.n = n
        self.helpers: list[dict] = []
        self.inflight: dict = {}      # page key -> helper
        self.spawned = False

    # ------------------------------------------------------------------ helpers
    def _spawn(self) -> None:
        self.spawned = True
        loop = asyncio.get_event_loop()
        for _ in range(self.n):
            mine, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                keep = theirs.fileno()
                try:
                    os.closerange(3, keep)
                    os.closerange(keep + 1, 1 << 20)
                except OSError:
                    pass
                _set_pdeathsig()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                code = 0
                try:
                    self._helper_loop(theirs)
                except BaseException:  # noqa: BLE001 - the worker renders itself then
                    code = 1
                os._exit(code)
            theirs.close()
            mine.setblocking(False)
            h = {"pid": pid, "sock": mine, "buf": bytearray(), "jobs": 0, "alive": True}
            self.helpers.append(h)
            loop.add_reader(mine.fileno(), self._readable, h)

    def _helper_loop(self, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        while True:
            head = f.read(4)
            if len(head) < 4:
                return
            key = pickle.loads(f.read(int.from_bytes(head, "big")))
            body, resume = self.app.render_page(*key)
            out = pickle.dumps((key, body, resume), protocol=pickle.HIGHEST_PROTOCOL)
            sock.sendall(len(out).to_bytes(4, "big") + out)

    def _dead(self, h: dict) -> None:
        if not h["alive"]:
            return
        h["alive"] = False
        try:
            asyncio.get_event_loop().remove_reader(h["sock"].fileno())
        except (RuntimeError, ValueError):
            pass
        h["sock"].close()
        for k in [k for k, owner in self.inflight.items() if owner is h]:
            del self.inflight[k]
        try:
            os.waitpid(h["pid"], os.WNOHANG)
        except ChildProcessError:
            pass

    def _readable(self, h: dict) -> None:
        try:
            data = h["sock"].recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._dead(h)
            return
        buf = h["buf"]
        buf += data
        while len(buf) >= 4:
            n = int.from_bytes(buf[:4], "big")
            if len(buf) < 4 + n:
                break
            key, body, resume = pickle.loads(bytes(buf[4:4 + n]))
            del buf[:4 + n]
            h["jobs"] -= 1
            self.inflight.pop(key, None)
            self.app.counts.add(_SLOT["ahead"])
            self.app._cache_put(key, (body, resume))

    def pids(self) -> list[int]:
        return [h["pid"] for h in self.helpers if h["alive"]]

    # ------------------------------------------------------------------ the worker's side
    def in_flight(self, key) -> bool:
        return key in self.inflight

    def wait(self, key, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while key in self.inflight:
            h = self.inflight[key]
            left = deadline - time.monotonic()
            if left <= 0:
                self._dead(h)   # hung: the worker renders itself
                return
            r, _, _ = select.select([h["sock"]], [], [], left)
            if r:
                self._readable(h)

    def want(self, chain, start) -> None:
        """Have the n pages from `start` on cached or being rendered."""
        if not self.spawned:
            self._spawn()
        live = [h for h in self.helpers if h["alive"]]
        if not live:
            return
        app = self.app
        for d in range(self.n):
            key = (chain, start)
            if key not in app.pages and key not in self.inflight:
                # Idle helpers only: a page someone waits for is then always one a helper is
                # rendering right now, never one queued behind other listings' pages.
                idle = [x for x in live if x["jobs"] == 0]
                if not idle:
                    return
                h = idle[0]
                out = pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)
                try:
                    h["sock"].setblocking(True)
                    h["sock"].sendall(len(out).to_bytes(4, "big") + out)
                    h["sock"].setblocking(False)
                except OSError:
                    self._dead(h)
                    return
                h["jobs"] += 1
                self.inflight[key] = h
            if d + 1 < self.n:
                start = app.next_start(chain, start)
                if start is None:
                    return


# ============================================================================ HTTP protocol
class _Conn(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and pipelining, minimal parsing (request line, header lines,
    Content-Length bodies are read and dropped; chunked request bodies are refused)."""

    MAX_HEAD = 64 * 1024

    def __init__(self, app: App, loop) -> None:
        self.app = app
        self.loop = loop
        self.buf = bytearray()
        self.transport = None
        self.closing = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        buf = self.buf
        buf += data
        while not self.closing:
            while buf[:2] == b"\r\n":
                del buf[:2]
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > self.MAX_HEAD:
                    self.respond(431, [(b"Content-Type", JSON_TYPE)], b'{"error":{"code":431}}',
                                 False, False)
                return
            lines = bytes(buf[:end]).split(b"\r\n")
            req = lines[0].split(b" ")
            if len(req) != 3 or not req[2].startswith(b"HTTP/1."):
                self.respond(400, [(b"Content-Type", JSON_TYPE)],
                             b'{"error":{"code":400,"message":"bad request line"}}', False, False)
                return
            method, target, version = req
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip()
            if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
                self.respond(501, [(b"Content-Type", JSON_TYPE)],
                             b'{"error":{"code":501,"message":"chunked request bodies"}}', False, False)
                return
            try:
                clen = int(headers.get(b"content-length", b"0") or b"0")
            except ValueError:
                clen = -1
            if clen < 0:
                self.respond(400, [(b"Content-Type", JSON_TYPE)],
                             b'{"error":{"code":400,"message":"bad Content-Length"}}', False, False)
                return
            total = end + 4 + clen
            if len(buf) < total:
                return
            del buf[:total]
            conn = headers.get(b"connection", b"").lower()
            keep = (b"close" not in conn) if version == b"HTTP/1.1" else (b"keep-alive" in conn)
            try:
                (status, hdrs, body), _kind = self.app.handle(method, target, headers)
            except Exception as exc:  # noqa: BLE001 - a server bug must show, not hang the client
                sys.stderr.write(f"scale_server: error answering {target!r}: {exc!r}\n")
                status, hdrs = 500, [(b"Content-Type", JSON_TYPE)]
                body = json.dumps({"error": {"code": 500,
                                             "message": f"scale_server error: {exc!r}"}}).encode()
                keep = False
            self.respond(status, hdrs, body, keep, method == b"HEAD")

    def respond(self, status: int, headers, body, keep: bool, head_only: bool) -> None:
        out = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, "Status").encode()))
        for k, v in headers:
            out += k + b": " + v + b"\r\n"
        out += b"Content-Length: %d\r\n" % len(body)
        if not keep:
            out += b"Connection: close\r\n"
        out += b"\r\n"
        if not head_only and len(body) <= 65536:
            out += body
            self.transport.write(out)
        else:
            self.transport.write(out)
            if not head_only:
                self.transport.write(body)
        if not keep:
            self.closing = True
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closing = True


# ============================================================================ server process
def _set_pdeathsig() -> None:
    """Die with the parent (a killed server must not leave workers behind)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


def _worker(sock: socket.socket, app: App, on_start=None) -> None:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    if on_start is not None:
        on_start(loop)

    async def main() -> None:
        server = await loop.create_server(lambda: _Conn(app, loop), sock=sock)
        async with server:
            await server.serve_forever()

    try:
        loop.run_until_complete(main())
    except (KeyboardInterrupt, SystemExit):
        pass


def serve(args) -> int:
    """The server process: bind, print READY, fork workers, serve until SIGTERM/SIGINT."""
    ns = Namespace(args.dirs, args.files, args.wide, args.nested, args.odd, args.max_size)
    ns._prepare()   # build the tables once, before forking
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(1024)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    endpoint = f"http://{args.host}:{port}"
    workers = max(1, args.workers)
    counts = SharedCounts(workers, args.counts_file)
    app = App(ns, args.bucket, args.external_url or endpoint, counts, args.page_cache_mb << 20,
              args.render_ahead, args.log)
    parent = os.getpid()
    children: list[int] = []
    for w in range(2, workers + 1):
        pid = os.fork()
        if pid == 0:
            _set_pdeathsig()
            if os.getppid() != parent:
                os._exit(0)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            counts.row = w
            try:
                _worker(sock, app)
            finally:
                os._exit(0)
        children.append(pid)
    counts.row = 1

    def stop(*_):
        for pid in children + (app.ahead.pids() if app.ahead else []):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def watch_stdin(loop) -> None:
        """The parent holds our stdin pipe: its end (the parent died) stops the server. A
        loop reader, not a thread: render-ahead helpers are forked from this process."""
        def readable() -> None:
            try:
                data = os.read(0, 4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                stop()
        os.set_blocking(0, False)
        loop.add_reader(0, readable)

    sys.stdout.write(f"READY {endpoint}\n")
    sys.stdout.flush()
    _worker(sock, app, watch_stdin if args.exit_on_stdin_eof else None)
    stop()
    return 0


# ============================================================================ the class
class ScaleServer:
    """The synthetic bucket in a child process (so a test's GIL never slows it).

    `names`, `size_of`, `object_bytes`, `generation_of`, `md5_of`, `crc32c_of` and `count` are
    computed here, by the same code the server runs. `counts` is a snapshot
    (collections.Counter) of the requests answered, by kind (KINDS), read from shared memory;
    `reset_counts()` starts them again from zero; `media_bytes` counts media body bytes sent.
    """

    def __init__(self, bucket: str = DEFAULT_BUCKET, dirs: int = 100, files: int = 10000, wide: int = 0,
                 host: str = "127.0.0.1", port: int = 0, external_url: str | None = None, *,
                 nested: int = 0, odd: bool = False, max_size: int = 4096, workers: int = 1,
                 page_cache_mb: int = 384, render_ahead: int = 2, log_path: str | None = None) -> None:
        self.bucket = bucket
        self.host = host
        self.requested_port = port
        self.external_url = external_url
        self.workers = workers
        self.page_cache_mb = page_cache_mb
        self.render_ahead = render_ahead
        self.log_path = log_path
        self.namespace = Namespace(dirs, files, wide, nested, odd, max_size)
        self.port = 0
        self.endpoint = ""
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None
        self._counts: SharedCounts | None = None
        self._counts_path: str | None = None
        self._stderr = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def argv(self) -> list[str]:
        ns = self.namespace
        argv = [sys.executable, os.path.abspath(__file__), "--bucket", self.bucket,
                "--dirs", str(ns.dirs), "--files", str(ns.files), "--wide", str(ns.wide),
                "--nested", str(ns.nested), "--max-size", str(ns.max_size), "--host", self.host,
                "--port", str(self.requested_port), "--workers", str(self.workers),
                "--page-cache-mb", str(self.page_cache_mb), "--render-ahead", str(self.render_ahead)]
        if ns.odd:
            argv.append("--odd")
        if self.external_url:
            argv += ["--external-url", self.external_url]
        if self.log_path:
            argv += ["--log", os.path.abspath(self.log_path)]
        return argv

    def start(self, timeout: float = 30.0) -> "ScaleServer":
        if self._proc is not None:
            return self
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        fd, self._counts_path = tempfile.mkstemp(prefix="scale-server-counts-", dir=shm)
        os.close(fd)
        self._counts = SharedCounts(self.workers, self._counts_path, create=True)
        self._stderr = tempfile.TemporaryFile()
        argv = self.argv() + ["--counts-file", self._counts_path, "--exit-on-stdin-eof"]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, start_new_session=True)
        self.pid = self._proc.pid
        deadline = time.monotonic() + timeout
        line = b""
        try:
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"scale_server did not say READY within {timeout:.0f} s")
                r, _, _ = select.select([self._proc.stdout], [], [], left)
                if r:
                    chunk = os.read(self._proc.stdout.fileno(), 1)
                    if not chunk:
                        raise RuntimeError("scale_server exited before READY")
                    line += chunk
            if not line.startswith(b"READY "):
                raise RuntimeError(f"scale_server said {line!r}")
        except RuntimeError as exc:
            err = self._stderr_text()
            self.stop()
            raise RuntimeError(f"{exc}; stderr:\n{err}") from None
        self.endpoint = line.split()[1].decode()
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        # Both sides have it mapped now: unlinked, it cannot outlive them (a killed test).
        try:
            os.unlink(self._counts_path)
        except FileNotFoundError:
            pass
        self._counts_path = None
        return self

    def _stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()   # SIGTERM by pid: the server stops its workers
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        if self._counts is not None:
            self._counts.close()
            self._counts = None
        if self._counts_path is not None:
            try:
                os.unlink(self._counts_path)
            except FileNotFoundError:
                pass
            self._counts_path = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> "ScaleServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ counts
    @property
    def counts(self) -> collections.Counter:
        with self._lock:
            if self._counts is None:
                return collections.Counter()
            return self._counts.counter()

    def reset_counts(self) -> None:
        with self._lock:
            if self._counts is not None:
                self._counts.reset()

    @property
    def media_bytes(self) -> int:
        with self._lock:
            return 0 if self._counts is None else self._counts.media_bytes()

    def page_stats(self) -> dict:
        """How listing pages were served since the last reset_counts(): {"rendered" (for the
        request), "ahead" (by a render-ahead helper), "cached", "waited" (for a helper)}."""
        with self._lock:
            return dict.fromkeys(PAGE_STATS, 0) if self._counts is None else self._counts.page_stats()

    # ------------------------------------------------------------------ the bucket's contents
    def names(self) -> Iterator[str]:
        return self.namespace.names()

    def count(self) -> int:
        return self.namespace.count()

    def size_of(self, name: str) -> int:
        return self.namespace.size_of(name)

    def generation_of(self, name: str) -> int:
        return self.namespace.generation_of(name)

    def object_bytes(self, name: str) -> bytes:
        return self.namespace.object_bytes(name)

    def md5_of(self, name: str) -> str:
        return self.namespace.md5_of(name)

    def crc32c_of(self, name: str) -> str:
        return self.namespace.crc32c_of(name)

    def __contains__(self, name: str) -> bool:
        return name in self.namespace


# ============================================================================ the walk
def walk(endpoint: str, bucket: str, prefix: str = "", delimited: bool = True, api: str = "gcs", *,
         fields: str | None = STOREFS_LIST_FIELDS, max_results: int | None = None,
         collect: bool = False) -> dict:
    """The direct listing walk: every page of the listing of `prefix`, sequentially, on one
    keep-alive http.client connection, each page JSON-decoded. Delimited: directory by
    directory, depth first in byte order (each directory's pages first, then its
    sub-prefixes); flat: one listing without a delimiter.

    GCS requests look like storefs's (maxResults=1000 and its `fields=`; fields=None asks for
    full resources); v0 requests like listAll()'s (no maxResults). Returns {"objects",
    "prefixes", "pages", "seconds"} (+ "names" and "prefix_list" in order when `collect`).
    """
    if api not in ("gcs", "firebase", "v0"):
        raise ValueError(f"api must be gcs or firebase, not {api!r}")
    v0 = api != "gcs"
    u = urllib.parse.urlsplit(endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    path = (f"/v0/b/{quote_name(bucket)}/o" if v0 else f"/storage/v1/b/{quote_name(bucket)}/o")
    if max_results is None and not v0:
        max_results = PAGE_MAX
    objects = prefixes = pages = 0
    names: list[str] = []
    prefix_list: list[str] = []
    loads = json.loads
    stack = [prefix]
    t0 = time.perf_counter()
    try:
        while stack:
            p = stack.pop()
            subs: list[str] = []
            token = None
            while True:
                q = [("prefix", p)] if p or v0 else []
                if delimited:
                    q.append(("delimiter", "/"))
                if max_results is not None:
                    q.append(("maxResults", str(max_results)))
                if fields and not v0:
                    q.append(("fields", fields))
                if token:
                    q.append(("pageToken", token))
                target = path + "?" + "&".join(f"{k}={quote_name(v)}" for k, v in q)
                conn.request("GET", target)
                r = conn.getresponse()
                body = r.read()
                if r.status != 200:
                    raise RuntimeError(f"walk: GET {target} -> {r.status} {body[:300]!r}")
                page = loads(body)
                pages += 1
                items = page.get("items") or ()
                objects += len(items)
                pp = page.get("prefixes") or ()
                prefixes += len(pp)
                subs.extend(pp)
                if collect:
                    names.extend(it["name"] for it in items)
                    prefix_list.extend(pp)
                token = page.get("nextPageToken")
                if not token:
                    break
            if delimited:
                stack.extend(reversed(subs))
    finally:
        conn.close()
    out = {"objects": objects, "prefixes": prefixes, "pages": pages, "seconds": time.perf_counter() - t0}
    if collect:
        out["names"] = names
        out["prefix_list"] = prefix_list
    return out


# ============================================================================ CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Synthetic GCS / Firebase Storage v0 bucket server.")
    p.add_argument("--bucket", default=DEFAULT_BUCKET)
    p.add_argument("--dirs", type=int, default=100)
    p.add_argument("--files", type=int, default=10000)
    p.add_argument("--wide", type=int, default=0, help="entries of the one wide directory wide/")
    p.add_argument("--nested", type=int, default=0, help="levels of the deep/ tree (with placeholders)")
    p.add_argument("--odd", action="store_true", help="add odd/ names that need encoding")
    p.add_argument("--max-size", type=int, default=4096, help="largest object size (bytes)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--external-url", default=None, help="base URL of selfLink/mediaLink")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes sharing the port (each has its own page cache and helpers)")
    p.add_argument("--page-cache-mb", type=int, default=384, help="rendered-page cache per worker (MiB)")
    p.add_argument("--render-ahead", type=int, default=2,
                   help="helper processes per worker rendering the next listing pages (0: none)")
    p.add_argument("--log", default=None, metavar="FILE",
                   help="append one line per request (pid, kind, method, target, range) to FILE")
    p.add_argument("--counts-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--exit-on-stdin-eof", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--walk", action="store_true", help="start a server, walk it, print the speed")
    p.add_argument("--runs", type=int, default=3, help="walks (--walk); the median is reported")
    p.add_argument("--fresh", action="store_true",
                   help="a new server for every walk, so none is answered from the page cache (--walk)")
    p.add_argument("--flat", action="store_true", help="walk without a delimiter (--walk)")
    p.add_argument("--api", default="gcs", choices=("gcs", "firebase"), help="protocol (--walk)")
    p.add_argument("--full", action="store_true", help="walk with full resources, no fields= (--walk)")
    return p


def _walk_cli(args) -> int:
    """--walk: the direct listing walk, `--runs` times, against one server (the first walk is
    cold, the next ones are answered from the page cache) or a new server per walk (--fresh:
    every walk cold); prints each walk and the median."""
    def server() -> ScaleServer:
        return ScaleServer(args.bucket, args.dirs, args.files, args.wide, args.host, 0, args.external_url,
                           nested=args.nested, odd=args.odd, max_size=args.max_size, workers=args.workers,
                           page_cache_mb=args.page_cache_mb, render_ahead=args.render_ahead)

    api = "gcs" if args.api == "gcs" else "v0"
    shape = (f"{args.dirs} dirs x {args.files} files{f' + wide {args.wide}' if args.wide else ''}, api={api}, "
             f"{'flat' if args.flat else 'delimited'}"
             + ("" if api == "v0" else f", {'full resources' if args.full else 'storefs fields='}"))
    results = []
    s = None
    try:
        for run in range(args.runs):
            if s is None or args.fresh:
                if s is not None:
                    s.stop()
                s = server().start(timeout=120)
                if run == 0:
                    print(f"{s.count():,} objects ({shape}); {os.cpu_count()} CPUs, load average "
                          f"{os.getloadavg()[0]:.2f}", flush=True)
            s.reset_counts()
            r = walk(s.endpoint, args.bucket, delimited=not args.flat, api=api,
                     fields=None if args.full else STOREFS_LIST_FIELDS)
            if r["objects"] != s.count():
                print(f"walk {run + 1}: {r['objects']} objects, expected {s.count()}", file=sys.stderr)
                return 1
            results.append(r)
            st = s.page_stats()
            how = ", ".join(f"{k} {v}" for k, v in st.items() if v)
            print(f"walk {run + 1}: {r['objects']:,} objects, {r['prefixes']:,} prefixes, "
                  f"{r['pages']:,} pages in {r['seconds']:.2f} s: {r['pages'] / r['seconds']:,.0f} pages/s, "
                  f"{r['objects'] / r['seconds']:,.0f} objects/s (pages: {how})", flush=True)
    finally:
        if s is not None:
            s.stop()
    med = statistics.median(r["seconds"] for r in results)
    r0 = results[0]
    print(f"median of {len(results)}: {med:.2f} s, {r0['pages'] / med:,.0f} pages/s, "
          f"{r0['objects'] / med:,.0f} objects/s; load average now {os.getloadavg()[0]:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for what in ("dirs", "files", "wide", "nested", "max_size", "port"):
        if getattr(args, what) < 0:
            print(f"scale_server: --{what.replace('_', '-')} must be >= 0", file=sys.stderr)
            return 2
    if args.walk:
        return _walk_cli(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
