"""Every mutation fails with EROFS, and the bucket is left untouched."""

import os

from storefs_testlib import BUCKET, errname, errno_of, open_close

FILE = "files/hello.txt"

MUTATIONS = {
    "create": lambda m: open_close(m.p("files/new.txt"), os.O_WRONLY | os.O_CREAT | os.O_EXCL),
    "create_in_root": lambda m: open_close(m.p("new.txt"), os.O_WRONLY | os.O_CREAT),
    "open_wronly": lambda m: open_close(m.p(FILE), os.O_WRONLY),
    "open_rdwr": lambda m: open_close(m.p(FILE), os.O_RDWR),
    "open_trunc": lambda m: open_close(m.p(FILE), os.O_WRONLY | os.O_TRUNC),
    "open_append": lambda m: open_close(m.p(FILE), os.O_WRONLY | os.O_APPEND),
    "open_rdwr_creat": lambda m: open_close(m.p(FILE), os.O_RDWR | os.O_CREAT),
    "mkdir": lambda m: os.mkdir(m.p("files/newdir")),
    "unlink": lambda m: os.unlink(m.p(FILE)),
    "rmdir": lambda m: os.rmdir(m.p("empty")),
    "rename": lambda m: os.rename(m.p(FILE), m.p("files/renamed.txt")),
    "rename_dir": lambda m: os.rename(m.p("empty"), m.p("empty2")),
    "link": lambda m: os.link(m.p(FILE), m.p("files/hard.txt")),
    "symlink": lambda m: os.symlink("hello.txt", m.p("files/sym.txt")),
    "chmod": lambda m: os.chmod(m.p(FILE), 0o644),
    "chmod_dir": lambda m: os.chmod(m.p("files"), 0o755),
    "chown": lambda m: os.chown(m.p(FILE), 1, 1),
    "utime": lambda m: os.utime(m.p(FILE), (0, 0)),
    "truncate": lambda m: os.truncate(m.p(FILE), 0),
    "setxattr": lambda m: os.setxattr(m.p(FILE), "user.storefs.meta.color", b"red"),
    "setxattr_new": lambda m: os.setxattr(m.p(FILE), "user.anything", b"x"),
    "removexattr": lambda m: os.removexattr(m.p("meta/with token.txt"), "user.storefs.meta.color"),
}


def test_every_mutation_is_erofs(mount, emulator, corpus):
    m = mount()
    wrong = {}
    for what, op in MUTATIONS.items():
        got = errname(errno_of(op, m))
        if got != "EROFS":
            wrong[what] = got
    assert wrong == {}, f"expected EROFS, got {wrong}"
    # nothing changed, on either side
    with open(m.p(FILE), "rb") as f:
        assert f.read() == corpus.data[FILE]
    for gone in ["files/new.txt", "new.txt", "files/newdir", "files/renamed.txt", "files/hard.txt",
                 "files/sym.txt", "empty2"]:
        assert not os.path.lexists(m.p(gone)), gone
    items, _ = emulator.list_objects(BUCKET)
    assert sorted(i["name"] for i in items) == sorted(corpus.data)
    assert emulator.get_object(BUCKET, FILE)["generation"] == corpus.resources[FILE]["generation"]
