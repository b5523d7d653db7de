"""Directories from prefixes, hidden names, collisions, paging, ENOENT, mount sources."""

import errno
import os
import stat

from storefs_testlib import BUCKET, errname, errno_of, expected_tree, open_close


def test_root_listing(mount, corpus):
    m = mount()
    assert sorted(os.listdir(m.path)) == sorted(
        ["big", "clash", "dir1500", "empty", "enc", "files", "implicit", "long", "meta", "odd",
         "private", "weird"])


def test_odd_names_appear_exactly_as_stored(mount, corpus):
    m = mount()
    assert sorted(os.listdir(m.p("odd"))) == sorted(n.split("/", 1)[1] for n in corpus.ODD)
    # and bytes-wise too (no normalization of the unicode name)
    assert "ünïcødé-日本.txt".encode() in os.listdir(os.fsencode(m.p("odd")))


def test_invalid_names_are_hidden_not_mangled(mount, corpus):
    m = mount()
    assert os.listdir(m.p("weird")) == ["visible.txt"]
    assert os.listdir(m.p("long")) == [corpus.LONG_OK.split("/", 1)[1]]
    # `weird//double.txt` must not be reachable as weird/double.txt either
    assert errno_of(os.stat, m.p("weird", "double.txt")) == errno.ENOENT


def test_placeholder_makes_empty_directory(mount):
    m = mount()
    assert stat.S_ISDIR(os.stat(m.p("empty")).st_mode)
    assert os.listdir(m.p("empty")) == []


def test_implicit_directories(mount, corpus):
    m = mount()
    assert os.listdir(m.p("implicit")) == ["deep"]
    assert stat.S_ISDIR(os.stat(m.p("implicit")).st_mode)
    assert stat.S_ISDIR(os.stat(m.p("implicit/deep")).st_mode)
    assert os.listdir(m.p("implicit/deep")) == ["file.txt"]
    with open(m.p("implicit/deep/file.txt"), "rb") as f:
        assert f.read() == corpus.data["implicit/deep/file.txt"]


def test_directory_shadows_file_of_same_name(mount, corpus):
    m = mount()
    assert stat.S_ISDIR(os.stat(m.p("clash")).st_mode)
    assert os.listdir(m.p("clash")) == ["inner.txt"]
    assert os.listdir(m.path).count("clash") == 1
    with open(m.p("clash/inner.txt"), "rb") as f:
        assert f.read() == corpus.data["clash/inner.txt"]


def test_dir_with_1500_objects_lists_completely(mount, corpus):
    m = mount()
    names = os.listdir(m.p("dir1500"))
    assert len(names) == 1500
    assert sorted(names) == [f"f{i:04d}.txt" for i in range(1500)]
    with open(m.p("dir1500/f1499.txt"), "rb") as f:
        assert f.read() == corpus.data["dir1500/f1499.txt"]


def test_listing_pages_with_max_results_at_most_1000(mount, proxy):
    m = mount(endpoint=proxy.endpoint)
    assert len(os.listdir(m.p("dir1500"))) == 1500
    pages = [r for r in proxy.requests("list") if r.prefix == "dir1500/"]
    assert len(pages) >= 2, f"expected several list pages for dir1500/, saw {len(pages)}"
    for r in pages:
        assert r.status == 200
        assert r.query.get("delimiter") == ["/"], r.path
        assert 0 < int(r.query.get("maxResults", ["0"])[0]) <= 1000, r.path


def test_ls_l_makes_no_request_per_entry(mount, proxy):
    """`ls -l` on a big directory is one listing pass (GCS protocol)."""
    m = mount(endpoint=proxy.endpoint)
    names = os.listdir(m.p("dir1500"))
    sizes = {n: os.lstat(m.p("dir1500", n)).st_size for n in names}
    assert len(sizes) == 1500 and sizes["f0007.txt"] == len(b"dir1500/f0007.txt\n")
    per_entry = [r for r in proxy.requests("metadata") if (r.name or "").startswith("dir1500/")]
    assert len(per_entry) <= 15, f"{len(per_entry)} metadata GETs for 1500 entries"


def test_whole_tree_matches_reference_model(mount, corpus):
    m = mount()
    dirs, files = expected_tree(corpus.data)
    for rel, children in dirs.items():
        assert sorted(os.listdir(m.p(rel) if rel else m.path)) == sorted(children), rel


MISSING = ["nope", "files/nope.txt", "odd/with space", "dir1500/f1500.txt", "empty/x",
           "implicit/deep/file.txt.bak", "clash/inner", "odd/what", "weird/visible.txt2",
           "nope/deeper/still"]


def test_missing_paths_are_enoent(mount):
    m = mount()
    wrong = []
    for rel in MISSING:
        for what, fn in (("stat", os.stat), ("open", open_close),
                         ("listdir", os.listdir)):
            got = errno_of(fn, m.p(rel))
            if got != errno.ENOENT:
                wrong.append(f"{what}({rel!r}) -> {errname(got)}")
    assert wrong == []


def test_missing_paths_stay_enoent_on_repeat(mount):
    m = mount()
    for _ in range(3):   # the negative cache must answer the same
        assert errno_of(os.stat, m.p("files/ghost.txt")) == errno.ENOENT


def test_source_gs_uri_with_prefix_mounts_subtree(mount, corpus):
    m = mount(f"gs://{BUCKET}/odd")
    assert sorted(os.listdir(m.path)) == sorted(n.split("/", 1)[1] for n in corpus.ODD)
    with open(m.p("a+b.txt"), "rb") as f:
        assert f.read() == corpus.data["odd/a+b.txt"]
    assert errno_of(os.stat, m.p("odd")) == errno.ENOENT


def test_source_gs_uri_bucket_only(mount):
    m = mount(f"gs://{BUCKET}")
    assert "implicit" in os.listdir(m.path) and "odd" in os.listdir(m.path)


def test_source_firebase_url_mounts_subtree(mount, corpus):
    m = mount(f"https://firebasestorage.googleapis.com/v0/b/{BUCKET}/o/implicit")
    assert os.listdir(m.path) == ["deep"]
    with open(m.p("deep/file.txt"), "rb") as f:
        assert f.read() == corpus.data["implicit/deep/file.txt"]


def test_readdir_inode_numbers_are_the_stat_inode_numbers(mount, corpus):
    """d_ino from getdents equals st_ino from stat for every entry (find -inum, du and rsync
    compare them), also for names not looked up before the listing."""
    m = mount(BUCKET)
    d = m.p("dir1500")
    with os.scandir(d) as it:
        listed = {e.name: e.inode() for e in it}
    assert len(listed) == 1500
    mismatched = [n for n, ino in listed.items() if os.stat(os.path.join(d, n)).st_ino != ino]
    assert mismatched == [], f"{len(mismatched)} entries differ, e.g. {mismatched[:3]}"
    assert os.stat(d).st_ino == os.stat(os.path.join(d, ".")).st_ino
