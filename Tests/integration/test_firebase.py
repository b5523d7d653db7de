"""storefs over the Firebase Storage v0 REST API (docs/protocol.md §2), through firebase_fixture.

The objects live in their own bucket, `fb-bucket`: v0 reads create download tokens (they
write to the bucket), which must never leak into the corpus bucket the GCS tests look at.
The first tests check the fixture itself against protocol.md (no storefs needed); if they
fail, the storefs results below mean nothing.
"""

from __future__ import annotations

import concurrent.futures
import errno
import gzip
import http.client
import json
import os
import random
import stat
import statistics
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest

import tls_fixture
from firebase_fixture import BAD_PREFIX_MESSAGE, TOKENS_KEY, v0_url
from gcs_emulator import quote_name
from storefs_testlib import errname, errno_of, expected_tree

FB = "fb-bucket"
MiB = 1 << 20
BIG = "big/random-3MiB.bin"
GZ = "gz/compressed.txt.gz"
TOKEN_OBJ = "tok/with-token.txt"              # tokens "fbtok-aaa,fbtok-bbb"
ODD = ["odd/with space+plus.txt", "odd/ünïcødé-日本.txt", "odd/hash#q?.txt", "odd/100%.txt"]
MANY = [f"many/f{i:04d}.txt" for i in range(2500)]
LS1000 = [f"ls1000/n{i:04d}.bin" for i in range(1000)]
PAGES = [f"pages/p{i:02d}.txt" for i in range(30)] + [f"pages/d{i}/x.txt" for i in range(5)]


def _ls_size(i: int) -> int:
    return (i * 7919) % 3001


@pytest.fixture(scope="module")
def fbdata(emulator) -> dict[str, bytes]:
    """Uploads fb-bucket once; returns name -> bytes of everything uploaded."""
    emulator.create_bucket(FB, exist_ok=True)
    rng = random.Random(20261130)
    items: list[tuple[str, bytes, dict]] = [
        ("docs/readme.txt", b"storefs over firebase v0\n", {"content_type": "text/plain"}),
        ("docs/notes/todo.md", b"# todo\n- read through v0\n", {"content_type": "text/markdown"}),
        (BIG, rng.randbytes(3 * MiB + 17), {}),
        (GZ, gzip.compress(b"stored bytes, not gunzipped\n" * 500, mtime=0),
         {"content_type": "text/plain", "content_encoding": "gzip"}),
        ("zero.bin", b"", {}),
        ("empty/", b"", {}),
        ("inv//double.txt", b"hidden\n", {}),
        ("inv/ok.txt", b"ok\n", {}),
        ("private/secret.txt", b"top secret\n", {}),
        ("private/more/deep.txt", b"deeper secret\n", {}),
        (TOKEN_OBJ, b"has a token\n",
         {"content_type": "text/plain", "metadata": {TOKENS_KEY: "fbtok-aaa,fbtok-bbb",
                                                     "color": "green"}}),
    ]
    items += [(n, f"odd {n}\n".encode(), {"content_type": "text/plain"}) for n in ODD]
    # with tokens, as a file uploaded through Firebase has: the fixture makes a missing one
    # with a PATCH of fake-gcs-server that costs more than the v0 GET itself (the service
    # makes it inside the GET), and `ls -l` of 2,500 names measures storefs and the v0 server
    items += [(n, f"{n}\n".encode(), {"metadata": {TOKENS_KEY: f"many-{i}"}}) for i, n in enumerate(MANY)]
    # with tokens already, so `ls -l` timing is not about token creation
    items += [(n, bytes([i % 251]) * _ls_size(i), {"metadata": {TOKENS_KEY: f"ls-{i}"}})
              for i, n in enumerate(LS1000)]
    items += [(n, f"page {n}\n".encode(), {}) for n in PAGES]

    def one(item):
        name, data, kwargs = item
        res = emulator.upload(FB, name, data, **kwargs)
        assert int(res["size"]) == len(data), name
        return name, data

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return dict(pool.map(one, items))


def _upload_fresh(emulator, data: bytes, prefix: str = "fresh") -> str:
    """A new token-less object (v0 reads give every object a token, so tests needing a
    token-less one make their own)."""
    name = f"{prefix}/{uuid.uuid4().hex[:10]}.bin"
    emulator.upload(FB, name, data)
    return name


def _http(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30, context=tls_fixture.client_context()) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def _list(fb, prefix: str | None, **q) -> tuple[int, dict | bytes]:
    params = dict(q)
    if prefix is not None:
        params["prefix"] = prefix
    params.setdefault("delimiter", "/")
    query = "&".join(f"{k}={quote_name(str(v))}" for k, v in params.items())
    status, _, body = _http(f"{fb.endpoint}/v0/b/{FB}/o?{query}")
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def _meta_url(fb, name: str) -> str:
    return f"{fb.endpoint}/v0/b/{FB}/o/{quote_name(name)}"


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while True:
            b = os.read(fd, MiB)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def fb_mount(bare_mount, fb, source: str = FB, options=(), **kwargs):
    return bare_mount(source, endpoint=fb.endpoint,
                      options=["protocol=firebase", "anonymous", *options], **kwargs)


def _bucket_names(emulator) -> list[str]:
    items, _ = emulator.list_objects(FB)
    return [i["name"] for i in items]


# ====================================================================== the fixture itself
def test_fixture_v0_listing_follows_protocol(firebase, fbdata):
    status, root = _list(firebase, "")
    assert status == 200
    assert set(root) == {"prefixes", "items"}          # last page: no nextPageToken
    assert {"docs/", "many/", "empty/", "inv/", "private/"} <= set(root["prefixes"])
    assert {"name": "zero.bin", "bucket": FB} in root["items"]
    assert all(set(i) == {"name", "bucket"} for i in root["items"]), "items carry name+bucket only"
    # empty arrays are present; the placeholder is not an item under itself
    assert _list(firebase, "empty/") == (200, {"prefixes": [], "items": []})
    # names with an empty segment are dropped, prefixes and items alike
    assert _list(firebase, "inv/") == (200, {"prefixes": [],
                                             "items": [{"name": "inv/ok.txt", "bucket": FB}]})
    status, body = _list(firebase, "docs")
    assert status == 400 and BAD_PREFIX_MESSAGE.encode() in json.dumps(body).encode()
    # default page 1000, nextPageToken = next item's name, maxResults capped at 1000
    status, p1 = _list(firebase, "many/")
    assert status == 200 and len(p1["items"]) == 1000 and p1["nextPageToken"] == "many/f1000.txt"
    status, p2 = _list(firebase, "many/", pageToken=p1["nextPageToken"])
    assert p2["items"][0]["name"] == "many/f1000.txt" and p2["nextPageToken"] == "many/f2000.txt"
    status, p3 = _list(firebase, "many/", pageToken=p2["nextPageToken"])
    assert len(p3["items"]) == 500 and "nextPageToken" not in p3
    assert _list(firebase, "many/", maxResults=5000)[1]["nextPageToken"] == "many/f1000.txt"
    assert _list(firebase, "many/", maxResults=3)[1]["nextPageToken"] == "many/f0003.txt"
    # every page repeats all prefixes (§7.10)
    status, q1 = _list(firebase, "pages/", maxResults=10)
    status, q2 = _list(firebase, "pages/", maxResults=10, pageToken=q1["nextPageToken"])
    assert q1["prefixes"] == q2["prefixes"] == [f"pages/d{i}/" for i in range(5)]
    firebase.empty_first_page = True
    status, e1 = _list(firebase, "pages/")
    assert e1["items"] == [] and e1["nextPageToken"] == "pages/p00.txt"


def test_fixture_v0_metadata_and_token_creation(firebase, emulator, fbdata):
    name = _upload_fresh(emulator, b"0123456789" * 10)
    gcs = emulator.get_object(FB, name)
    assert TOKENS_KEY not in (gcs.get("metadata") or {})
    status, _, body = _http(_meta_url(firebase, name))
    assert status == 200
    meta = json.loads(body)
    assert meta["name"] == name and meta["bucket"] == FB
    assert meta["generation"] == gcs["generation"], "token creation must keep the generation"
    assert meta["metageneration"] == "2" and meta["size"] == "100"
    assert meta["contentEncoding"] == "identity"
    assert meta["contentType"] == "application/octet-stream"
    for k in ("timeCreated", "updated"):
        assert len(meta[k]) == 24 and meta[k][19] == "." and meta[k].endswith("Z"), meta[k]
    assert meta["crc32c"].isdigit(), "v0 crc32c is a decimal uint32 (emulator)"
    assert meta["md5Hash"] == gcs["md5Hash"]
    token = meta["downloadTokens"]
    assert str(uuid.UUID(token)) == token
    assert emulator.get_object(FB, name)["metadata"][TOKENS_KEY] == token
    assert "metadata" not in meta, "the token key is not custom metadata"
    again = json.loads(_http(_meta_url(firebase, name))[2])
    assert again["metageneration"] == "2" and again["downloadTokens"] == token
    tok = json.loads(_http(_meta_url(firebase, TOKEN_OBJ))[2])
    assert tok["downloadTokens"] == "fbtok-aaa,fbtok-bbb" and tok["metadata"] == {"color": "green"}
    assert tok["metageneration"] == "1"
    status, _, body = _http(_meta_url(firebase, "docs/absent.txt"))
    assert (status, body) == (404, b"Not Found")
    # a literal '/' in the object segment is no v0 object route
    assert _http(f"{firebase.endpoint}/v0/b/{FB}/o/docs/readme.txt")[0] == 404


def test_fixture_v0_media_ranges_and_headers(firebase, fbdata):
    url = _meta_url(firebase, BIG) + "?alt=media"
    status, headers, body = _http(url)
    assert status == 200 and body == fbdata[BIG]
    meta = json.loads(_http(_meta_url(firebase, BIG))[2])
    assert headers["x-goog-generation"] == meta["generation"]
    assert headers["x-goog-metadatageneration"] == meta["metageneration"]
    status, headers, body = _http(url, {"Range": "bytes=1000-1999"})
    assert status == 206 and body == fbdata[BIG][1000:2000]
    assert headers["content-range"] == f"bytes 1000-1999/{len(fbdata[BIG])}"
    status, _, body = _http(url, {"Range": f"bytes={len(fbdata[BIG]) + 5}-"})
    assert status == 200 and len(body) == len(fbdata[BIG]), "unsatisfiable range is ignored"
    gz = _meta_url(firebase, GZ) + "?alt=media"
    status, headers, body = _http(gz, {"Accept-Encoding": "gzip"})
    assert status == 200 and body == fbdata[GZ] and headers["content-encoding"] == "gzip"
    status, _, body = _http(gz)
    assert body == gzip.decompress(fbdata[GZ]), "no Accept-Encoding: gzip -> transcoded"


def test_fixture_v0_rules_auth_and_faults(firebase, auth_server, fbdata):
    firebase.set_rules([("private/", {"alice"}), ("docs/", "auth"), ("", "public")])
    secret = _meta_url(firebase, "private/secret.txt")
    assert _http(secret)[0] == 403
    status, _, body = _http(_meta_url(firebase, "private/absent"))
    assert status == 403 and json.loads(body) == {
        "error": {"code": 403, "message": "Permission denied. No READ permission."}}
    status, body = _list(firebase, "private/")
    assert status == 403 and body["error"]["message"] == "Permission denied. No LIST permission."
    alice = auth_server.mint_id_token("alice")
    bob = auth_server.mint_id_token("bob")
    assert _http(secret, {"Authorization": f"Firebase {alice}"})[0] == 200
    assert _http(secret, {"Authorization": f"Firebase {bob}"})[0] == 403
    assert _http(_meta_url(firebase, "docs/readme.txt"))[0] == 403
    assert _http(_meta_url(firebase, "docs/readme.txt"), {"Authorization": f"Firebase {bob}"})[0] == 200
    expired = auth_server.mint_id_token("alice", lifetime=-1)
    for bad in (f"Firebase {expired}", f"Firebase {alice[:-4]}AAAA", "Firebase garbage",
                f"Bearer {alice}", "Bearer ya29.unknown", "Basic Zm9vOmJhcg=="):
        assert _http(secret, {"Authorization": bad})[0] == 401, bad
    admin = auth_server.mint_access_token("sa@example")
    assert _http(secret, {"Authorization": f"Bearer {admin}"})[0] == 200
    # a matching download token skips the rules; a wrong one does not
    tokens = json.loads(_http(secret, {"Authorization": f"Bearer {admin}"})[2])["downloadTokens"]
    assert _http(secret + f"?alt=media&token={tokens.split(',')[0]}")[2] == b"top secret\n"
    assert _http(secret + "?alt=media&token=nope")[0] == 403
    assert all("token=<redacted>" in r.target for r in firebase.requests("media") if r.download_token)
    assert not any(alice in r.target or tokens in r.target for r in firebase.log)
    assert {r.auth for r in firebase.log} >= {"none", "firebase", "bearer", "invalid"}
    auth_server.reject_current_id_tokens()
    assert _http(secret, {"Authorization": f"Firebase {alice}"})[0] == 401
    firebase.fail_next(2, 429)
    codes = [_http(_meta_url(firebase, "zero.bin"))[0] for _ in range(3)]
    assert codes == [429, 429, 200]
    firebase.fail_always(503, kinds=("media",))
    assert _http(_meta_url(firebase, "zero.bin"))[0] == 200
    assert _http(_meta_url(firebase, "zero.bin") + "?alt=media")[0] == 503
    firebase.clear_faults()
    assert _http(_meta_url(firebase, "zero.bin") + "?alt=media")[0] == 200


# ====================================================================== storefs
def test_listing_and_reads_are_byte_exact(bare_mount, firebase, emulator, fbdata):
    m = fb_mount(bare_mount, firebase)
    dirs, files = expected_tree(_bucket_names(emulator))
    for d in ["", "docs", "docs/notes", "odd", "big", "gz", "empty", "inv", "tok", "private",
              "private/more", "pages"]:
        assert sorted(os.listdir(m.p(d))) == sorted(dirs[d]), f"listing of /{d}"
    assert stat.S_ISDIR(os.stat(m.p("empty")).st_mode) and os.listdir(m.p("empty")) == []
    assert errname(errno_of(os.stat, m.p("inv/double.txt"))) == "ENOENT"
    for rel, name in files.items():
        if name.startswith(("many/", "ls1000/", "pages/", "fresh/")):
            continue
        assert os.stat(m.p(rel)).st_size == len(fbdata[name]), rel
        assert _read(m.p(rel)) == fbdata[name], rel
    fd = os.open(m.p(BIG), os.O_RDONLY)
    try:
        for off, n in [(0, 1), (MiB - 3, 7), (2 * MiB + 12345, 100000), (len(fbdata[BIG]) - 5, 50)]:
            assert os.pread(fd, n, off) == fbdata[BIG][off:off + n], (off, n)
    finally:
        os.close(fd)
    assert firebase.counts["list"] >= 1 and firebase.counts["media"] >= 1
    assert firebase.counts["status:400"] == 0, [r.target for r in firebase.log if r.status == 400]
    assert firebase.counts["write"] == 0


def test_v0_listing_of_2500_objects_is_complete(bare_mount, firebase, fbdata):
    m = fb_mount(bare_mount, firebase)
    names = os.listdir(m.p("many"))
    assert len(names) == len(set(names)) == 2500
    assert sorted(names) == sorted(n.split("/", 1)[1] for n in MANY)
    pages = [r for r in firebase.requests("list") if r.prefix == "many/"]
    assert len(pages) >= 3, f"{len(pages)} list requests for 2,500 items (pages hold ≤1,000)"
    assert [r.page_token for r in pages if r.page_token][:2] == ["many/f1000.txt", "many/f2000.txt"]


def test_empty_pages_and_repeated_prefixes(bare_mount, firebase, fbdata):
    firebase.empty_first_page = True        # the first page of every listing has no items
    firebase.max_page_size = 7              # and every page repeats all 5 prefixes
    m = fb_mount(bare_mount, firebase)
    names = os.listdir(m.p("pages"))
    want = sorted([f"p{i:02d}.txt" for i in range(30)] + [f"d{i}" for i in range(5)])
    assert sorted(names) == want, "entries lost or duplicated across short/empty pages"
    assert all(stat.S_ISDIR(os.stat(m.p("pages", f"d{i}")).st_mode) for i in range(5))
    assert len([r for r in firebase.requests("list") if r.prefix == "pages/"]) >= 6


def _serial_metadata_latency(fb, names: list[str]) -> float:
    """Median seconds of one v0 metadata GET on a keep-alive connection, one at a time."""
    conn = http.client.HTTPSConnection("127.0.0.1", fb.port, timeout=30,
                                       context=tls_fixture.client_context())
    times = []
    try:
        for name in names:
            t0 = time.monotonic()
            conn.request("GET", f"/v0/b/{FB}/o/{quote_name(name)}")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read()
            times.append(time.monotonic() - t0)
    finally:
        conn.close()
    return statistics.median(times)


def test_fixture_v0_answers_metadata_from_what_it_listed_until_the_bucket_changes(firebase, emulator, fbdata):
    """The v0 server asked fake-gcs-server for every metadata GET (2.5 ms of its CPU each here),
    which set the pace of `ls -l` over v0 (issue 49, item 6). What a listing or a GET brought
    answers later GETs until the bucket changes through the emulator, and a change is seen at once."""
    asked = []
    upstream = firebase._upstream

    def counted(method, path, *args, **kwargs):
        asked.append((method, path))
        return upstream(method, path, *args, **kwargs)

    firebase._upstream = counted
    try:
        status, page = _list(firebase, "ls1000/")
        assert status == 200 and len(page["items"]) == 1000
        listed = len(asked)
        sizes = [json.loads(_http(_meta_url(firebase, n))[2])["size"] for n in LS1000[:50]]
        assert sizes == [str(_ls_size(i)) for i in range(50)]
        assert len(asked) == listed, \
            f"50 metadata GETs after the listing asked fake-gcs-server {len(asked) - listed} times: {asked[listed:][:3]}"
        name = _upload_fresh(emulator, b"v1")
        assert json.loads(_http(_meta_url(firebase, name))[2])["size"] == "2"
        emulator.upload(FB, name, b"v2 longer")
        assert json.loads(_http(_meta_url(firebase, name))[2])["size"] == "9", "a new generation was not seen"
        emulator.delete(FB, name)
        assert _http(_meta_url(firebase, name))[0] == 404, "a deleted object still answered"
    finally:
        firebase._upstream = upstream


def _timed_ls_sizes(path: str, timeout: float) -> tuple[float, dict[str, int]]:
    """(seconds `ls -ln path` took, name -> size it showed)."""
    t0 = time.monotonic()
    r = subprocess.run(["ls", "-ln", path], capture_output=True, text=True, timeout=timeout)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    sizes = {}
    for line in r.stdout.splitlines()[1:]:
        fields = line.split(None, 8)
        sizes[fields[8]] = int(fields[4])
    return elapsed, sizes


def test_ls_l_of_2500_v0_files_takes_under_10_s_with_metadata_gets_in_flight_at_once(bare_mount, firebase, fbdata):
    """v0 listings carry no sizes: `ls -l` costs one metadata GET per name, fetched 16 at a
    time beside the kernel's lookups (issue 49, item 6: 17.6-18.5 s for 2,500 names, set by
    the v0 fixture, which asked fake-gcs-server for each; a v0 server answering in ~2 ms lets
    it take a few seconds)."""
    firebase.metadata_delay = 0.002         # each answer takes 2 ms, as a server's might
    m = fb_mount(bare_mount, firebase)
    firebase.reset()
    elapsed, sizes = _timed_ls_sizes(m.p("many"), timeout=120)
    assert sizes == {n.split("/", 1)[1]: len(n) + 1 for n in MANY}
    meta = [q for q in firebase.requests("metadata") if q.name and q.name.startswith("many/")]
    print(f"\nls -l of 2,500 v0 files: {elapsed:.1f} s, {len(meta)} metadata GETs, "
          f"{firebase.max_inflight['metadata']} at most in flight at the server")
    assert len(meta) >= 2500, "v0 list items carry no size: one metadata GET per name"
    assert firebase.max_inflight["metadata"] > 1, "the metadata GETs went one at a time"
    assert elapsed < 10, f"ls -l of 2,500 v0 files took {elapsed:.1f} s"


def test_ls_l_of_1000_files_is_fast_and_sizes_are_right(bare_mount, firebase, fbdata):
    firebase.metadata_delay = 0.02          # makes one-at-a-time metadata GETs plainly slow
    serial = _serial_metadata_latency(firebase, LS1000[:25]) * len(LS1000)
    firebase.reset()
    m = fb_mount(bare_mount, firebase)
    elapsed, sizes = _timed_ls_sizes(m.p("ls1000"), timeout=80)
    assert sizes == {f"n{i:04d}.bin": _ls_size(i) for i in range(1000)}
    meta = [r for r in firebase.requests("metadata") if r.name and r.name.startswith("ls1000/")]
    assert len(meta) >= 1000, "v0 list items carry no size: one metadata GET per item"
    assert 4 <= firebase.max_inflight["metadata"] <= 128, \
        f"metadata GETs should be parallel but bounded (max in flight {firebase.max_inflight['metadata']})"
    assert elapsed < 0.5 * serial, \
        f"ls -l of 1,000 files took {elapsed:.1f} s; one GET at a time would take {serial:.1f} s"
    before = len(firebase.requests("metadata"))
    r = subprocess.run(["ls", "-ln", m.p("ls1000")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1001
    assert len(firebase.requests("metadata")) == before, "metadata not cached for the second ls"


def test_denied_prefix_is_eacces_beside_readable_ones(bare_mount, firebase, fbdata):
    firebase.set_rules([("private/", "deny"), ("", "public")])
    m = fb_mount(bare_mount, firebase)
    assert "private" in os.listdir(m.path)
    with pytest.raises(PermissionError) as exc:
        os.listdir(m.p("private"))
    assert exc.value.errno == errno.EACCES
    with pytest.raises(PermissionError) as exc:
        _read(m.p("private/secret.txt"))
    assert exc.value.errno == errno.EACCES
    # rules run before existence: a missing name under a denied prefix is EACCES too
    assert errname(errno_of(os.stat, m.p("private/no-such-file"))) == "EACCES"
    assert _read(m.p("docs/readme.txt")) == fbdata["docs/readme.txt"]
    assert sorted(os.listdir(m.p("docs"))) == ["notes", "readme.txt"]
    assert firebase.counts["status:403"] >= 2


def test_download_url_xattr_is_the_v0_token_url(bare_mount, firebase, emulator, fbdata):
    m = fb_mount(bare_mount, firebase)
    url = os.getxattr(m.p(TOKEN_OBJ), "user.storefs.download_url").decode()
    assert url == v0_url(firebase.endpoint, FB, TOKEN_OBJ, "fbtok-aaa")
    for name in ODD:
        got = os.getxattr(m.p(name), "user.storefs.download_url").decode()
        token = emulator.get_object(FB, name)["metadata"][TOKENS_KEY].split(",")[0]
        assert got == v0_url(firebase.endpoint, FB, name, token), name
    assert v0_url(firebase.endpoint, FB, ODD[0], "T").endswith(
        "/v0/b/fb-bucket/o/odd%2Fwith%20space%2Bplus.txt?alt=media&token=T")
    # the URL is a capability: it reads the object with no credentials, whatever the rules
    firebase.set_rules([])
    status, _, body = _http(url)
    assert (status, body) == (200, fbdata[TOKEN_OBJ])


def test_token_creation_does_not_invalidate_cached_blocks(bare_mount, firebase, emulator, fbdata):
    data = random.Random(77).randbytes(2 * MiB + 5)
    name = _upload_fresh(emulator, data)
    firebase.create_tokens = False          # first mount: the object stays token-less
    m = fb_mount(bare_mount, firebase)
    assert _read(m.p(name)) == data
    assert firebase.settle(), "v0 requests did not settle"
    first = firebase.v0_metadata(FB, name)
    assert first["metageneration"] == "1" and "downloadTokens" not in first
    assert [r for r in firebase.requests("media") if r.name == name], "no media GET at all?"
    assert bare_mount.unmount(m) == []

    firebase.create_tokens = True           # another client reads over v0: token, metageneration 2
    status, _, body = _http(_meta_url(firebase, name))
    bumped = json.loads(body)
    assert status == 200 and bumped["metageneration"] == "2" and bumped["downloadTokens"]
    assert bumped["generation"] == first["generation"]

    firebase.reset()
    again = fb_mount(bare_mount, firebase, cache_dir=m.cache_dir)
    assert os.stat(again.p(name)).st_size == len(data)
    assert _read(again.p(name)) == data
    assert firebase.settle()
    seen = [r for r in firebase.requests("metadata") if r.name == name]
    assert seen, "the remount never fetched the object's metadata (so never saw metageneration 2)"
    media = [r.target for r in firebase.requests("media") if r.name == name]
    assert media == [], f"a metageneration bump invalidated cached blocks: {len(media)} media GETs"


def test_new_generation_is_read_anew(bare_mount, firebase, emulator, fbdata):
    old, new = b"first generation\n" * 1000, b"second generation!\n" * 900
    name = _upload_fresh(emulator, old)
    m = fb_mount(bare_mount, firebase, options=["stat_ttl=1"])
    assert _read(m.p(name)) == old
    emulator.upload(FB, name, new)
    time.sleep(1.5)
    firebase.reset()
    assert os.stat(m.p(name)).st_size == len(new)
    assert _read(m.p(name)) == new, "a new generation must never be served from old blocks"
    assert firebase.settle()    # the fixture logs a request after its last byte went out
    assert [r for r in firebase.requests("media") if r.name == name]


@pytest.mark.parametrize("status", [429, 402])
def test_quota_errors_on_every_request_are_eagain(bare_mount, firebase, fbdata, status):
    m = fb_mount(bare_mount, firebase)
    assert sorted(os.listdir(m.p("docs"))) == ["notes", "readme.txt"]
    firebase.fail_always(status)
    t0 = time.monotonic()
    e = errno_of(_read, m.p("odd/hash#q?.txt"))
    assert errname(e) == "EAGAIN", f"got {errname(e)} after {time.monotonic() - t0:.1f} s"
    assert firebase.counts[f"status:{status}"] >= 1
    if status == 429:
        assert firebase.counts["status:429"] >= 2, "429 is retried before giving up"
    firebase.clear_faults()
    assert _read(m.p("odd/hash#q?.txt")) == b"odd odd/hash#q?.txt\n", \
        "after the 429s stop the same file reads (the error was not cached)"


def test_transient_503s_are_retried(bare_mount, firebase, fbdata):
    m = fb_mount(bare_mount, firebase)
    firebase.fail_next(2, 503, kinds=("metadata", "media"))
    assert _read(m.p("docs/notes/todo.md")) == fbdata["docs/notes/todo.md"]
    assert firebase.counts["status:503"] == 2


def test_firebase_storage_emulator_host_selects_v0(bare_mount, firebase, fbdata):
    firebase.emulator_mode = True           # accepts `Bearer owner` / mock tokens like the emulator
    m = bare_mount(FB, endpoint=None, env={"FIREBASE_STORAGE_EMULATOR_HOST": firebase.host})
    assert _read(m.p("docs/readme.txt")) == fbdata["docs/readme.txt"]
    assert sorted(os.listdir(m.p("docs"))) == ["notes", "readme.txt"]
    assert firebase.counts["list"] >= 1 and firebase.counts["media"] >= 1
    assert firebase.counts["status:401"] == 0


def test_firebase_url_source_mounts_a_prefix(bare_mount, firebase, fbdata):
    src = f"https://firebasestorage.googleapis.com/v0/b/{FB}/o/docs"
    m = fb_mount(bare_mount, firebase, source=src)
    assert sorted(os.listdir(m.path)) == ["notes", "readme.txt"]
    assert _read(m.p("notes/todo.md")) == fbdata["docs/notes/todo.md"]
