"""403 from the server becomes EACCES; the rest of the mount keeps working."""

import errno
import os

import pytest

from storefs_testlib import errname, errno_of, open_close


def test_forbidden_objects_are_eacces(mount, proxy, corpus):
    m = mount(endpoint=proxy.endpoint)
    with pytest.raises(PermissionError) as exc:
        with open(m.p(corpus.PRIVATE), "rb") as f:
            f.read()
    assert exc.value.errno == errno.EACCES
    with pytest.raises(PermissionError) as exc:
        os.listdir(m.p("private"))
    assert exc.value.errno == errno.EACCES
    assert errname(errno_of(open_close, m.p("private/more/hidden.txt"))) == "EACCES"
    assert proxy.counts["denied"] >= 1, "storefs did not go through the proxy"
    # the same mount still serves everything else
    with open(m.p("files/hello.txt"), "rb") as f:
        assert f.read() == corpus.data["files/hello.txt"]
    assert sorted(os.listdir(m.p("implicit/deep"))) == ["file.txt"]
    with open(m.p(corpus.BIG), "rb") as f:
        f.seek(5 << 20)
        assert f.read(4096) == corpus.data[corpus.BIG][5 << 20:(5 << 20) + 4096]
    assert proxy.counts["media"] >= 2


def test_eacces_is_not_cached_as_enoent(mount, proxy, corpus):
    m = mount(endpoint=proxy.endpoint)
    for _ in range(2):
        assert errname(errno_of(os.stat, m.p(corpus.PRIVATE))) == "EACCES"
    assert errname(errno_of(os.stat, m.p("files/absent.txt"))) == "ENOENT"
