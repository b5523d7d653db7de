"""The synthetic bucket server (scale_server.py): exact listings, objects, ranges, both protocols.

The scale tests and benchmarks trust this server the way the rest of the suite trusts
fake-gcs-server, so it is checked here against an independent reference: every expected
listing is computed in this file from `ScaleServer.names()` by brute force, checksums with a
bitwise CRC32C and hashlib, and the wire shapes are the ones docs/protocol.md describes
(§2.2-§2.4 for Firebase v0, §5 and §5.3 for the GCS JSON API). No FUSE mount is needed.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse

import pytest

from scale_server import ODD_NAMES, STOREFS_LIST_FIELDS, ScaleServer, quote_name, walk

BUCKET = "scale-test-bucket"
HERE = os.path.dirname(os.path.abspath(__file__))
RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


# ====================================================================== references
def crc32c(data: bytes) -> int:
    """Bitwise CRC32C (Castagnoli), independent of the server's table tricks."""
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF


def b64_crc(data: bytes) -> str:
    return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode()


def b64_md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def expected_listing(names: list[str], prefix: str, delimiter: str | None,
                     hide_placeholder: bool = False) -> tuple[list[str], list[str]]:
    """(items, prefixes) of a complete listing, by brute force over every name."""
    items: list[str] = []
    prefixes: list[str] = []
    for n in names:
        if not n.startswith(prefix):
            continue
        if delimiter:
            k = n.find(delimiter, len(prefix))
            if k >= 0:
                p = n[:k + len(delimiter)]
                if not prefixes or prefixes[-1] != p:
                    prefixes.append(p)
                continue
        if hide_placeholder and n == prefix:
            continue
        items.append(n)
    return items, prefixes


# ====================================================================== HTTP helpers
class Client:
    """One keep-alive connection to the server."""

    def __init__(self, endpoint: str) -> None:
        u = urllib.parse.urlsplit(endpoint)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)

    def get(self, path: str, headers: dict | None = None, method: str = "GET"):
        self.conn.request(method, path, headers=headers or {})
        r = self.conn.getresponse()
        body = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, body

    def json(self, path: str, status: int = 200) -> dict:
        st, h, body = self.get(path)
        assert st == status, (path, st, body[:300])
        assert h["content-type"].startswith("application/json"), h
        return json.loads(body)

    def close(self) -> None:
        self.conn.close()


def query(**params) -> str:
    """A query string encoded the storefs way (docs/protocol.md §1.3)."""
    return "&".join(f"{k}={quote_name(str(v))}" for k, v in params.items() if v is not None)


def gcs_list_path(bucket: str = BUCKET, **params) -> str:
    return f"/storage/v1/b/{quote_name(bucket)}/o?" + query(**params)


def v0_list_path(bucket: str = BUCKET, **params) -> str:
    return f"/v0/b/{quote_name(bucket)}/o?" + query(**params)


def list_all(client: Client, api: str, prefix: str, delimiter: str | None, max_results: int | None,
             fields: str | None = None) -> tuple[list[str], list[str], int]:
    """Follows nextPageToken to the end: (items, prefixes, pages), checking each page's size."""
    items: list[str] = []
    prefixes: list[str] = []
    token = None
    pages = 0
    while True:
        params = dict(prefix=prefix, delimiter=delimiter, maxResults=max_results, pageToken=token)
        if api == "gcs":
            page = client.json(gcs_list_path(fields=fields, **params))
        else:
            page = client.json(v0_list_path(**params))
            assert isinstance(page["items"], list) and isinstance(page["prefixes"], list)
        pages += 1
        got = page.get("items", [])
        if max_results is not None:
            assert len(got) + len(page.get("prefixes", [])) <= max_results
        items += [it["name"] for it in got]
        prefixes += page.get("prefixes", [])
        token = page.get("nextPageToken")
        if not token:
            return items, prefixes, pages
        assert pages < 10000, "listing does not end"


# ====================================================================== fixtures
@pytest.fixture(scope="module")
def server():
    """3 dirs x 25 files, a 30-entry wide/, three deep/ levels with placeholders, odd/ names."""
    with ScaleServer(BUCKET, dirs=3, files=25, wide=30, nested=3, odd=True) as s:
        yield s


@pytest.fixture
def client(server):
    c = Client(server.endpoint)
    yield c
    c.close()


@pytest.fixture(scope="module")
def names(server) -> list[str]:
    return list(server.names())


# ====================================================================== the namespace
def test_names_are_unique_byte_ordered_and_counted(server, names):
    assert len(names) == server.count() == 3 * 25 + 30 + 3 * 4 + len(ODD_NAMES)
    assert len(set(names)) == len(names)
    assert [n.encode() for n in names] == sorted(n.encode() for n in names)
    assert names[0] == "d000/f00000.bin" and names[24] == "d000/f00024.bin"
    assert "wide/f000029.bin" in names and "deep/n1/n2/g2.bin" in names and "deep/" in names
    for n in names:
        size = server.size_of(n)
        assert 0 <= size <= 4096 and server.generation_of(n) > 0
        assert len(server.object_bytes(n)) == size
        if n.endswith("/"):
            assert size == 0   # placeholders are empty
    assert sum(server.size_of(n) == 0 for n in names) >= 1


def test_default_shape_widths():
    s = ScaleServer(dirs=100, files=10000, wide=100000)
    it = s.names()
    assert next(it) == "d000/f00000.bin"
    assert s.count() == 1_100_000
    assert "d099/f09999.bin" in s and "wide/f099999.bin" in s and "wide/f100000.bin" not in s


# ====================================================================== listings
@pytest.mark.parametrize("api", ["gcs", "v0"])
@pytest.mark.parametrize("max_results", [1, 7, None])
def test_delimited_walk_lists_every_name_once(server, client, names, api, max_results):
    """Directory by directory, every object exactly once across pages (placeholders aside:
    v0 hides the listed directory's own placeholder, §2.4; GCS lists it, §5)."""
    seen: list[str] = []
    stack = [""]
    while stack:
        prefix = stack.pop()
        items, prefixes, _ = list_all(client, api, prefix, "/", max_results)
        want_items, want_prefixes = expected_listing(names, prefix, "/", hide_placeholder=(api == "v0"))
        assert items == want_items, prefix
        assert prefixes == want_prefixes, prefix
        seen += items
        stack += reversed(prefixes)
    placeholders = [n for n in names if n.endswith("/")]
    expect = sorted(n for n in names if api == "gcs" or n not in placeholders)
    assert sorted(seen) == expect
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize("max_results", [1, 7, 1000])
def test_flat_listing_is_every_name_in_order(client, names, max_results):
    items, prefixes, pages = list_all(client, "gcs", "", None, max_results)
    assert items == names and prefixes == []
    assert pages == -(-len(names) // max_results)   # full pages: no empty last page


PREFIXES = ["", "d", "d0", "d001", "d001/", "d001/f0001", "d001/f00013.bin", "d001/f00013.bin/",
            "d001/f00013.binx", "deep", "deep/", "deep/n1/", "deep/n1/n2", "deep/n1/n2/", "deep/n1/n2/g",
            "odd/", "odd/sub dir/", "odd/ü", "odd/a+b", "odd/100%", "wide/", "wide/f00002", "zzz",
            "\U0010ffff", "d999/", "e", "d002/f00024.bin"]


@pytest.mark.parametrize("delimiter", ["/", None, "1"])
@pytest.mark.parametrize("prefix", PREFIXES)
def test_listing_of_any_prefix_is_exact(client, names, prefix, delimiter):
    """Whatever the prefix (a directory, a partial name, an object's exact name, a name
    plus '/', beyond the last name), pages of 3 give exactly the brute-force answer."""
    items, prefixes, _ = list_all(client, "gcs", prefix, delimiter, 3)
    assert (items, prefixes) == expected_listing(names, prefix, delimiter)
    if prefix == "" or (prefix.endswith("/") and not prefix.endswith("//")):
        v0_items, v0_prefixes, _ = list_all(client, "v0", prefix, delimiter, 3)
        assert (v0_items, v0_prefixes) == expected_listing(names, prefix, delimiter, hide_placeholder=True)
    else:   # v0 takes only directory prefixes, as the service and its emulator do
        st, _, body = client.get(v0_list_path(prefix=prefix, delimiter=delimiter))
        assert st == 400 and json.loads(body)["error"]["code"] == 400


def test_has_children_probe_of_an_object_name(client):
    """storefs's "is it a directory?" probe (GCSJSONStore.hasChildren): prefix NAME/,
    maxResults=1, fields=prefixes,items(name). An object has no children; a directory has."""
    probe = dict(delimiter="/", maxResults=1, fields="prefixes,items(name)")
    assert client.json(gcs_list_path(prefix="d001/f00013.bin/", **probe)) == {}
    assert client.json(gcs_list_path(prefix="nope/", **probe)) == {}
    page = client.json(gcs_list_path(prefix="deep/n1/", **probe))
    assert page == {"items": [{"name": "deep/n1/"}]}   # the placeholder itself comes first
    page = client.json(gcs_list_path(prefix="d001/", **probe))
    assert page == {"items": [{"name": "d001/f00000.bin"}]}
    # a one-name listing that also asks for nextPageToken (a small access check)
    page = client.json(gcs_list_path(prefix="d001/", delimiter="/", maxResults=1,
                                     fields="prefixes,nextPageToken,items(name)"))
    assert page["items"] == [{"name": "d001/f00000.bin"}] and page["nextPageToken"]
    # v0 (FirebaseV0Store.hasChildren): an object name's probe is empty and final; the
    # listed directory's own placeholder is not listed (§2.4), so its first file answers
    v0 = client.json(v0_list_path(prefix="d001/f00013.bin/", delimiter="/", maxResults=1))
    assert v0 == {"prefixes": [], "items": []}
    v0 = client.json(v0_list_path(prefix="deep/n1/n2/", delimiter="/", maxResults=1))
    assert [i["name"] for i in v0["items"]] == ["deep/n1/n2/g0.bin"] and v0["nextPageToken"]


def test_max_results_one_pages_through_prefixes_and_items(client, names):
    items, prefixes, pages = list_all(client, "gcs", "deep/", "/", 1)
    assert items == ["deep/", "deep/g0.bin", "deep/g1.bin", "deep/g2.bin"]
    assert prefixes == ["deep/n1/"]
    assert pages == 5
    # GCS counts items and prefixes together against maxResults (docs/protocol.md §5)
    page = client.json(gcs_list_path(delimiter="/", maxResults=2))
    assert page["prefixes"] == ["d000/", "d001/"] and "items" not in page and page["nextPageToken"]


def test_unknown_prefix_is_an_empty_listing(client):
    assert client.json(gcs_list_path(prefix="no/such/dir/", delimiter="/")) == {"kind": "storage#objects"}
    assert client.json(v0_list_path(prefix="no/such/dir/", delimiter="/")) == {"prefixes": [], "items": []}


def test_page_size_defaults_to_and_is_capped_at_1000():
    with ScaleServer(BUCKET, dirs=1, files=2500) as s:
        c = Client(s.endpoint)
        for mr in (None, 1000, 5000):
            page = c.json(gcs_list_path(prefix="d000/", delimiter="/", maxResults=mr))
            assert len(page["items"]) == 1000 and page["nextPageToken"]
        v0 = c.json(v0_list_path(prefix="d000/", delimiter="/"))   # listAll(): no maxResults
        assert len(v0["items"]) == 1000 and v0["nextPageToken"]
        items, _, pages = list_all(c, "v0", "d000/", "/", None)
        assert items == list(s.names()) and pages == 3
        c.close()


def test_page_tokens_are_opaque_and_checked(client):
    first = client.json(gcs_list_path(prefix="d001/", delimiter="/", maxResults=10))
    token = first["nextPageToken"]
    assert "d001" not in token   # opaque, not the name in clear
    second = client.json(gcs_list_path(prefix="d001/", delimiter="/", maxResults=10, pageToken=token))
    assert second["items"][0]["name"] == "d001/f00010.bin"
    # the same token is valid with another prefix: it only says where to resume (inside d001/)
    other = client.json(gcs_list_path(prefix="d00", delimiter="/", maxResults=10, pageToken=token))
    assert other["prefixes"] == ["d001/", "d002/"] and "items" not in other
    st, _, body = client.get(gcs_list_path(prefix="d001/", pageToken="!!not a token!!"))
    assert st == 400 and json.loads(body)["error"]["code"] == 400


def test_start_and_end_offsets(client, names):
    page = client.json(gcs_list_path(startOffset="d001/f00020.bin", endOffset="d002/f00002.bin"))
    want = [n for n in names if "d001/f00020.bin" <= n < "d002/f00002.bin"]
    assert [i["name"] for i in page["items"]] == want


# ====================================================================== objects and errors
def test_object_resource_is_realistic_and_consistent(server, client):
    name = next(n for n in server.names() if server.size_of(n) > 100)
    data = server.object_bytes(name)
    res = client.json(f"/storage/v1/b/{BUCKET}/o/{quote_name(name)}")
    gen = server.generation_of(name)
    assert res["kind"] == "storage#object" and res["name"] == name and res["bucket"] == BUCKET
    assert res["id"] == f"{BUCKET}/{name}/{gen}"
    assert res["size"] == str(len(data)) and res["generation"] == str(gen) and res["metageneration"] == "1"
    assert res["md5Hash"] == b64_md5(data) and res["crc32c"] == b64_crc(data)
    assert res["contentType"] and res["storageClass"] == "STANDARD" and res["etag"]
    assert RFC3339_MS.match(res["updated"]) and RFC3339_MS.match(res["timeCreated"])
    assert res["selfLink"] == f"{server.endpoint}/storage/v1/b/{BUCKET}/o/{quote_name(name)}"
    assert res["mediaLink"].startswith(
        f"{server.endpoint}/download/storage/v1/b/{BUCKET}/o/{quote_name(name)}?")
    # the listing carries the same resource
    page = client.json(gcs_list_path(prefix=name, maxResults=1))
    assert page["items"] == [res]
    # fields= trims, for objects.get and objects.list alike (storefs's list fields: §5)
    assert client.json(f"/storage/v1/b/{BUCKET}/o/{quote_name(name)}?fields=name,size") == \
        {"name": name, "size": res["size"]}
    trimmed = client.json(gcs_list_path(prefix=name, maxResults=1, fields=STOREFS_LIST_FIELDS))["items"][0]
    assert trimmed == {k: v for k, v in res.items() if k in (
        "name", "bucket", "size", "generation", "metageneration", "updated", "timeCreated", "contentType",
        "md5Hash", "crc32c")}
    st, _, body = client.get(gcs_list_path(fields="items(name"))
    assert st == 400


def test_checksums_match_the_bytes_for_many_sizes(server):
    """md5Hash and crc32c (base64 of the big-endian uint32, §5) are those of the bytes,
    including empty and tiny objects."""
    sized = {}
    for n in server.names():
        sized.setdefault(min(server.size_of(n), 5), n)
    assert set(sized) >= {0, 5}
    picked = list(sized.values()) + [n for n in server.names() if n.startswith("odd/")]
    for n in picked:
        data = server.object_bytes(n)
        assert server.md5_of(n) == b64_md5(data), n
        assert server.crc32c_of(n) == b64_crc(data), n


def test_bytes_differ_between_objects_and_offsets(server):
    a, b = "d000/f00001.bin", "d000/f00002.bin"
    da, db = server.object_bytes(a), server.object_bytes(b)
    assert da != db and server.object_bytes(a) == da   # deterministic
    big = max(server.names(), key=server.size_of)
    data = server.object_bytes(big)
    assert data[:16] != data[16:32] != data[32:48]      # no short period: a shifted read shows


def test_errors_are_404_json(client):
    def err(path, status=404, v0=False):
        st, h, body = client.get(path)
        assert st == status, (path, st, body)
        assert h["content-type"].startswith("application/json")
        e = json.loads(body)["error"]
        assert e["code"] == status and e["message"]
        if not v0:
            assert e["errors"][0]["reason"]
    err("/storage/v1/b/nope/o?prefix=")
    err("/storage/v1/b/nope")
    err(f"/storage/v1/b/nope/o/{quote_name('d000/f00000.bin')}")
    err(f"/storage/v1/b/{BUCKET}/o/{quote_name('d000/f99999.bin')}")
    err(f"/storage/v1/b/{BUCKET}/o/{quote_name('d000/')}")                  # a prefix, not an object
    err(f"/download/storage/v1/b/{BUCKET}/o/{quote_name('nope.bin')}?alt=media")
    err(f"/download/storage/v1/b/{BUCKET}/o/{quote_name('d000/f00000.bin')}?alt=media&generation=1")
    err("/v0/b/nope/o?prefix=&delimiter=%2F", v0=True)
    err(f"/v0/b/{BUCKET}/o/{quote_name('nope.bin')}", v0=True)
    err(f"/v0/b/{BUCKET}/o/{quote_name('nope.bin')}?alt=media", v0=True)
    err("/not/an/api")
    err(gcs_list_path(maxResults=0), 400)
    st, _, _ = client.get(gcs_list_path(), method="POST")
    assert st == 405


# ====================================================================== media
RANGE_CASES = [  # (Range header, slice of the object or "416", status)
    ("bytes=0-9", slice(0, 10), 206),
    ("bytes=10-", slice(10, None), 206),
    ("bytes=-7", slice(-7, None), 206),
    ("bytes=5-100000", slice(5, None), 206),
    (None, slice(None), 200),
    ("bytes=0-1,5-9", slice(None), 200),          # several ranges: the whole object
]


@pytest.mark.parametrize("route", ["download", "storage", "medialink", "v0"])
def test_ranged_reads_return_the_right_bytes(server, client, route):
    """One range per request: 206 with Content-Range (§5.3); x-goog-hash describes the whole
    object; v0 answers carry x-goog-generation (§2.3)."""
    name = next(n for n in server.names() if server.size_of(n) > 200 and n.startswith("d001/"))
    data = server.object_bytes(name)
    gen = server.generation_of(name)
    enc = quote_name(name)
    path = {
        "download": f"/download/storage/v1/b/{BUCKET}/o/{enc}?alt=media&generation={gen}",
        "storage": f"/storage/v1/b/{BUCKET}/o/{enc}?alt=media",
        "medialink": None,
        "v0": f"/v0/b/{BUCKET}/o/{enc}?alt=media",
    }[route]
    if route == "medialink":
        link = client.json(f"/storage/v1/b/{BUCKET}/o/{enc}")["mediaLink"]
        assert link.startswith(server.endpoint + "/")
        path = link[len(server.endpoint):]
    for rng, sl, status in RANGE_CASES:
        st, h, body = client.get(path, {"Range": rng} if rng else {})
        assert st == status, (rng, st, body[:200])
        assert body == data[sl], rng
        assert h["x-goog-generation"] == str(gen)
        assert h["x-goog-hash"] == f"crc32c={b64_crc(data)},md5={b64_md5(data)}"
        if status == 206:
            first = len(data) + sl.start if sl.start < 0 else sl.start
            assert h["content-range"] == f"bytes {first}-{first + len(body) - 1}/{len(data)}"
    st, h, _ = client.get(path, {"Range": f"bytes={len(data)}-"})
    assert st == 416 and h["content-range"] == f"bytes */{len(data)}"
    st, h, body = client.get(path, {"Range": "bytes=0-3"}, method="HEAD")
    assert st == 206 and body == b"" and h["content-length"] == "4"


def test_every_small_object_reads_back_exactly(server, client):
    for n in list(server.names())[::7]:
        data = server.object_bytes(n)
        st, _, body = client.get(f"/download/storage/v1/b/{BUCKET}/o/{quote_name(n)}?alt=media")
        assert st == 200 and body == data, n
        if data:
            st, _, body = client.get(f"/v0/b/{BUCKET}/o/{quote_name(n)}?alt=media",
                                     {"Range": f"bytes={len(data) // 2}-{len(data) - 1}"})
            assert st == 206 and body == data[len(data) // 2:], n


# ====================================================================== Firebase v0 shapes
def test_v0_list_shape(client):
    """§2.4: items carry only name and bucket; prefixes end in '/'; both lists are always
    there; the listed directory's placeholder is not listed; a token until the end."""
    page = client.json(v0_list_path(prefix="deep/", delimiter="/"))
    assert page == {"prefixes": ["deep/n1/"],
                    "items": [{"name": f"deep/g{i}.bin", "bucket": BUCKET} for i in range(3)]}
    page = client.json(v0_list_path(prefix="", delimiter="/", maxResults=2))
    assert page["prefixes"] == ["d000/", "d001/"] and page["items"] == [] and page["nextPageToken"]


def test_v0_metadata_shape(server, client):
    """§2.2: numbers as decimal strings, RFC 3339 times, md5Hash, crc32c, downloadTokens."""
    for name in ["odd/a+b.bin", "odd/ünïcødé-日本.bin", 'odd/quote"back\\slash.bin', "deep/n1/"]:
        data = server.object_bytes(name)
        meta = client.json(f"/v0/b/{BUCKET}/o/{quote_name(name)}")
        assert meta["name"] == name and meta["bucket"] == BUCKET
        assert meta["generation"] == str(server.generation_of(name)) and meta["metageneration"] == "1"
        assert meta["size"] == str(len(data))
        assert meta["md5Hash"] == b64_md5(data) and meta["crc32c"] == b64_crc(data)
        assert RFC3339_MS.match(meta["updated"]) and RFC3339_MS.match(meta["timeCreated"])
        assert meta["contentType"] and meta["contentEncoding"] == "identity"
        assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", meta["downloadTokens"])
        assert client.json(f"/v0/b/{BUCKET}/o/{quote_name(name)}") == meta   # deterministic
        if data:
            st, h, body = client.get(f"/v0/b/{BUCKET}/o/{quote_name(name)}?alt=media",
                                     {"Range": "bytes=1-"})
            assert st == 206 and body == data[1:] and h["x-goog-generation"] == meta["generation"]


def test_names_in_paths_and_queries_decode_like_the_service(server, client):
    """§1.3: a path keeps '+'; in a query '+' is a space and %2B a '+'."""
    res = client.json(f"/storage/v1/b/{BUCKET}/o/odd%2Fa+b.bin")
    assert res["name"] == "odd/a+b.bin"
    page = client.json(f"/storage/v1/b/{BUCKET}/o?prefix=odd%2Fa%2Bb")
    assert [i["name"] for i in page["items"]] == ["odd/a+b.bin"]
    page = client.json(f"/storage/v1/b/{BUCKET}/o?prefix=odd/with+space")
    assert [i["name"] for i in page["items"]] == ["odd/with space.bin"]
    st, _, _ = client.get(f"/storage/v1/b/{BUCKET}/o?prefix=%FF")   # not UTF-8
    assert st == 400


# ====================================================================== server behaviour
def test_counts_by_kind_and_reset(server, client):
    server.reset_counts()
    assert server.counts == {}
    name = quote_name("d000/f00003.bin")
    client.get(gcs_list_path(prefix="d000/", delimiter="/"))
    client.get(f"/storage/v1/b/{BUCKET}/o/{name}")
    client.get(f"/download/storage/v1/b/{BUCKET}/o/{name}?alt=media")
    client.get(f"/storage/v1/b/{BUCKET}/o/{name}?alt=media")
    client.get(v0_list_path(prefix="", delimiter="/"))
    client.get(f"/v0/b/{BUCKET}/o/{name}")
    client.get(f"/v0/b/{BUCKET}/o/{name}?alt=media", {"Range": "bytes=0-0"})
    client.get(f"/storage/v1/b/{BUCKET}")
    client.get("/whatever")
    assert server.counts == {"list": 1, "metadata": 1, "media": 2, "v0list": 1, "v0metadata": 1,
                             "v0media": 1, "other": 2}
    assert server.media_bytes >= 2 * server.size_of("d000/f00003.bin")
    server.reset_counts()
    assert server.counts == {}


def test_external_url_is_used_for_links():
    with ScaleServer(BUCKET, dirs=1, files=2, external_url="http://storage.example:8443/") as s:
        c = Client(s.endpoint)
        res = c.json(f"/storage/v1/b/{BUCKET}/o/{quote_name('d000/f00001.bin')}")
        assert res["mediaLink"].startswith("http://storage.example:8443/download/storage/v1/b/")
        assert res["selfLink"].startswith("http://storage.example:8443/storage/v1/b/")
        c.close()


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                for c in f.read().split():
                    out += _tree(int(c))
    except FileNotFoundError:
        pass
    return out


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}")
                 and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_stop_ends_every_process(tmp_path):
    s = ScaleServer(BUCKET, dirs=2, files=3000).start()
    try:
        walk(s.endpoint, BUCKET)   # full pages: the render-ahead helpers get forked
        pids = _tree(s.pid)
        assert len(pids) >= 2
    finally:
        s.stop()
    assert _gone(pids), f"left behind: {pids}"


def test_cli_prints_ready_and_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "scale_server.py"), "--dirs", "2",
                             "--files", "3", "--bucket", "cli-bucket", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        line = proc.stdout.readline().decode()
        m = re.fullmatch(r"READY (http://127\.0\.0\.1:(\d+))\n", line)
        assert m, line
        c = Client(m.group(1))
        assert [i["name"] for i in c.json("/storage/v1/b/cli-bucket/o")["items"]] == \
            ["d000/f00000.bin", "d000/f00001.bin", "d000/f00002.bin", "d001/f00000.bin", "d001/f00001.bin",
             "d001/f00002.bin"]
        c.close()
        pids = _tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert _gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_keep_alive_serves_many_requests_on_one_connection(server):
    c = Client(server.endpoint)
    sock = None
    for n in list(server.names())[:50]:
        st, _, body = c.get(f"/v0/b/{BUCKET}/o/{quote_name(n)}")
        assert st == 200
        sock = sock or c.conn.sock
        assert c.conn.sock is sock   # never reconnected
    c.close()


@pytest.mark.parametrize("workers,render_ahead,cache_mb", [(1, 0, 0), (1, 2, 1), (2, 1, 384)])
def test_listings_stay_exact_whatever_the_caching(workers, render_ahead, cache_mb):
    """Pages rendered ahead by helpers, served from the cache (or a cache too small for the
    walk), or by two workers: the same exact listing, walk after walk."""
    with ScaleServer(BUCKET, dirs=2, files=2500, wide=1500, nested=2, workers=workers,
                     render_ahead=render_ahead, page_cache_mb=cache_mb) as s:
        want = [n for n in s.names() if not n.endswith("/")]
        for api in ("gcs", "v0", "gcs"):
            r = walk(s.endpoint, BUCKET, api=api, collect=True)
            got = [n for n in r["names"] if not n.endswith("/")]
            assert got == want, api
        assert walk(s.endpoint, BUCKET, delimited=False, collect=True)["names"] == list(s.names())
        stats = s.page_stats()
        if render_ahead:
            assert stats["ahead"] > 0
        if cache_mb >= 384:
            assert stats["cached"] > 0


def test_walk_of_200000_objects_reports_its_speed(capsys):
    """The direct listing walk (the benchmarks' floor) over 20 x 10,000 objects: exact counts
    and a generous speed floor, so a broken or pathologically slow server fails here."""
    with ScaleServer(BUCKET, dirs=20, files=10000) as s:
        r = walk(s.endpoint, BUCKET)
        assert r["objects"] == 200_000 and r["prefixes"] == 20 and r["pages"] == 201
        assert s.counts == {"list": 201}
        flat = walk(s.endpoint, BUCKET, prefix="d013/", delimited=False)
        assert flat["objects"] == 10_000 and flat["pages"] == 10
        v0 = walk(s.endpoint, BUCKET, api="firebase")
        assert v0["objects"] == 200_000 and v0["pages"] == 201
    rate = r["objects"] / r["seconds"]
    with capsys.disabled():
        print(f"\nscale_server walk: 200,000 objects, {r['pages']} pages in {r['seconds']:.2f} s "
              f"({rate:,.0f} objects/s, {r['pages'] / r['seconds']:,.0f} pages/s); flat "
              f"{flat['objects'] / flat['seconds']:,.0f}/s, v0 {v0['objects'] / v0['seconds']:,.0f}/s")
    assert rate > 20_000, f"walk at {rate:,.0f} objects/s"
