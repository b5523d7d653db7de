"""Extended attributes `user.storefs.*` (README, "Extended attributes")."""

import ctypes
import errno
import os
import urllib.request

import tls_fixture
from gcs_emulator import quote_name
from storefs_testlib import BUCKET, errname, errno_of

P = "user.storefs."


def _get(path, name):
    return os.getxattr(path, name).decode()


# The emulator is not Google's endpoint: download URLs point at it (README, "Download URLs"),
# so a public URL handed out can be fetched from where the mount reads.

def test_download_url_with_firebase_token(mount, corpus, emulator):
    # protocol=gcs on an endpoint that is not Google's: fake-gcs-server serves no v0 path, so
    # a token object gets the JSON API media URL too (it was ENDPOINT/v0/...&token=tok-1, a
    # 404 here); protocol=firebase keeps the token URL (test_firebase.py).
    m = mount()
    name = corpus.TOKEN   # "meta/with token.txt", tokens "tok-1,tok-2"
    url = _get(m.p(name), P + "download_url")
    assert url == f"{emulator.endpoint}/download/storage/v1/b/test-bucket/o/meta%2Fwith%20token.txt?alt=media"
    with urllib.request.urlopen(url, timeout=10, context=tls_fixture.client_context()) as r:
        assert r.read() == corpus.data[name]


def test_download_url_without_token_is_public_url_of_the_endpoint(mount, corpus, emulator):
    m = mount()
    assert (_get(m.p(corpus.PLAIN), P + "download_url")
            == f"{emulator.endpoint}/download/storage/v1/b/test-bucket/o/meta%2Fplain%20file%2Bx.txt?alt=media")
    for name in [corpus.PLAIN, "odd/ünïcødé-日本.txt", "odd/hash#tag.txt", "odd/100%.txt", "odd/what?.txt"]:
        url = _get(m.p(name), P + "download_url")
        assert url == f"{emulator.endpoint}/download/storage/v1/b/{BUCKET}/o/{quote_name(name)}?alt=media"
        with urllib.request.urlopen(url, timeout=10, context=tls_fixture.client_context()) as r:
            assert r.read() == corpus.data[name], f"{url} does not serve {name}"


def test_object_attributes(mount, corpus):
    m = mount()
    name = corpus.TOKEN
    res = corpus.resources[name]
    path = m.p(name)
    assert _get(path, P + "gs_uri") == f"gs://{BUCKET}/{name}"
    assert _get(path, P + "content_type") == "text/plain; charset=utf-8"
    assert _get(path, P + "generation") == str(int(res["generation"]))
    assert _get(path, P + "md5") == res["md5Hash"]
    assert _get(path, P + "crc32c") == res["crc32c"]
    assert _get(path, P + "cache_control") == "public, max-age=60"
    assert _get(path, P + "meta.color") == "blue"


def test_gs_uri_keeps_raw_name(mount, corpus):
    m = mount()
    for name in corpus.ODD:
        assert _get(m.p(name), P + "gs_uri") == f"gs://{BUCKET}/{name}"
        assert _get(m.p(name), P + "generation") == corpus.resources[name]["generation"]


def test_content_encoding_of_gzip_object(mount, corpus):
    m = mount()
    assert _get(m.p(corpus.GZIP), P + "content_encoding") == "gzip"
    assert _get(m.p(corpus.GZIP), P + "content_type") == "text/plain"
    assert _get(m.p(corpus.GZIP), P + "md5") == corpus.resources[corpus.GZIP]["md5Hash"]


def test_missing_attributes_are_enodata(mount, corpus):
    m = mount()
    path = m.p(corpus.PLAIN)
    for name in [P + "content_encoding", P + "cache_control", P + "meta.color", P + "nonsense",
                 "user.other", P + "meta.nope"]:
        assert errname(errno_of(os.getxattr, path, name)) == "ENODATA", name


def test_other_namespaces_are_unsupported_so_ls_l_asks_once(mount, corpus):
    """`ls -l` asks every file for security.selinux and system.posix_acl_access unless the
    file system says it has no such namespace (EOPNOTSUPP); ENODATA costs two round trips a
    file. Counted by the mount's own FUSE op counters."""
    import json
    import subprocess
    m = mount()
    path = m.p(corpus.PLAIN)
    for name in ["security.selinux", "system.posix_acl_access", "trusted.x", "security.capability"]:
        assert errno_of(os.getxattr, path, name) == errno.EOPNOTSUPP, name
    d = m.p("dir1500")
    assert len(os.listdir(d)) == len(corpus.DIR1500)

    def getxattrs() -> int:
        return json.loads(os.getxattr(m.path, P + "stats"))["fuse"]["ops"].get("getxattr", 0)

    before = getxattrs()
    r = subprocess.run(["ls", "-l", d], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == len(corpus.DIR1500) + 1   # "total" and a line per file
    # The stats read itself is one; ls asks each namespace once (of 1,500 files).
    assert getxattrs() - before <= 6, getxattrs() - before


def test_listxattr_lists_present_attributes(mount, corpus):
    m = mount()
    names = set(os.listxattr(m.p(corpus.TOKEN)))
    assert {P + "download_url", P + "gs_uri", P + "content_type", P + "generation", P + "md5",
            P + "crc32c", P + "cache_control", P + "meta.color"} <= names
    assert P + "content_encoding" not in names
    # documented (README, storefs.8): the tokens are a capability, shown only in download_url
    assert P + "meta.firebaseStorageDownloadTokens" not in names
    assert (errname(errno_of(os.getxattr, m.p(corpus.TOKEN), P + "meta.firebaseStorageDownloadTokens"))
            == "ENODATA")
    for n in names:
        assert n.startswith(P), n
        os.getxattr(m.p(corpus.TOKEN), n)   # each listed name can be read
    gz = set(os.listxattr(m.p(corpus.GZIP)))
    assert P + "content_encoding" in gz and P + "cache_control" not in gz
    plain = set(os.listxattr(m.p(corpus.PLAIN)))
    assert not any(n.startswith(P + "meta.") for n in plain)


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    libc.getxattr.restype = ctypes.c_ssize_t
    libc.listxattr.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    libc.listxattr.restype = ctypes.c_ssize_t
    return libc


def test_size_query_and_erange(mount, corpus):
    m = mount()
    libc = _libc()
    path = m.p(corpus.TOKEN).encode()
    name = (P + "download_url").encode()
    want = os.getxattr(m.p(corpus.TOKEN), P + "download_url")
    n = libc.getxattr(path, name, None, 0)
    assert n == len(want)
    small = ctypes.create_string_buffer(n - 1)
    ctypes.set_errno(0)
    assert libc.getxattr(path, name, small, n - 1) == -1
    assert ctypes.get_errno() == errno.ERANGE
    full = ctypes.create_string_buffer(n)
    assert libc.getxattr(path, name, full, n) == n
    assert full.raw == want

    total = libc.listxattr(path, None, 0)
    listed = os.listxattr(m.p(corpus.TOKEN))
    assert total == sum(len(x.encode()) + 1 for x in listed)
    small = ctypes.create_string_buffer(total - 1)
    ctypes.set_errno(0)
    assert libc.listxattr(path, small, total - 1) == -1
    assert ctypes.get_errno() == errno.ERANGE
