"""The fixtures themselves: fake-gcs-server keeps awkward names, the proxy denies and forwards.

These need no storefs binary; if they fail, the other results mean nothing.
"""

import json
import urllib.error
import urllib.request

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
