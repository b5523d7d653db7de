"""The Debian package: packaging/build-deb, its contents and control fields, and a real
`apt-get install`, `mount -t fuse.storefs`, `apt-get remove --purge` round trip.

The package under test is the real one: `packaging/build-deb` makes a release build with the
Swift runtime linked statically (about 45 s from scratch on a 2-core machine, incremental in
.build/deb afterwards), so what is installed and mounted here is what users install. The
mount runs with the Swift toolchain's libraries hidden (a private mount namespace with a tmpfs
over them) to show that the package needs no toolchain. `--binary` is exercised with
STOREFS_BIN, the debug build, which build-deb must refuse unless told it is a test package.

Installing touches the real system (CI machines are disposable): the test refuses to start
when a storefs package or another storefs that `mount -t` could run instead is already
there, and always unmounts and purges what it installed.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import tempfile

import pytest

from storefs_testlib import BUCKET, EXIT_TIMEOUT_S, pid_alive, pids_with_arg, wait_pid_gone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_DEB = os.path.join(ROOT, "packaging", "build-deb")
HELLO = "files/hello.txt"

# What mount(8) and mount.fuse3 see at boot (systemd's PATH): /usr/bin/storefs must be the
# storefs they find, so nothing earlier on it may be called storefs.
BOOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SHADOWS = ["/usr/local/sbin/storefs", "/usr/local/bin/storefs", "/usr/sbin/storefs",
           "/sbin/mount.fuse.storefs", "/usr/sbin/mount.fuse.storefs"]

FILES = {   # path in the package -> mode
    "/usr/bin/storefs": "-rwxr-xr-x",
    "/usr/share/man/man8/storefs.8.gz": "-rw-r--r--",
    "/lib/systemd/system/storefs@.service": "-rw-r--r--",
    "/usr/share/doc/storefs/copyright": "-rw-r--r--",
    "/usr/share/doc/storefs/changelog.gz": "-rw-r--r--",
    "/usr/share/doc/storefs/README.md.gz": "-rw-r--r--",
    "/usr/share/doc/storefs/examples/fstab.example": "-rw-r--r--",
}
OWN_DIRS = ["/usr/share/doc/storefs"]   # directories only this package creates

# Libraries of the Swift toolchain: no Debian package has them.
TOOLCHAIN_LIB = re.compile(r"^(libswift|libFoundation|lib_Foundation|libdispatch\.|"
                           r"libBlocksRuntime\.|libXCTest\.|libTesting\.)")


def run(argv, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def check(argv, timeout=120, **kwargs) -> str:
    r = run(argv, timeout=timeout, **kwargs)
    assert r.returncode == 0, f"{' '.join(argv)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def apt_get(*args: str, cwd: str | None = None) -> str:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return check(["apt-get", "-q", "-y", "-o", "DPkg::Lock::Timeout=60", *args],
                 timeout=300, cwd=cwd, env=env)


def installed(pkg: str = "storefs") -> bool:
    r = run(["dpkg-query", "-W", "-f=${Status}", pkg])
    return r.returncode == 0 and r.stdout == "install ok installed"


def dpkg_knows(pkg: str = "storefs") -> bool:
    """True while dpkg has any record of the package (installed, or removed but not purged)."""
    return run(["dpkg", "-s", pkg]).returncode == 0


def owning_package(path: str) -> str | None:
    """The Debian package shipping `path`, trying the /lib <-> /usr/lib alias of usrmerge."""
    candidates = [path, os.path.realpath(path)]
    for p in list(candidates):
        candidates.append(p[4:] if p.startswith("/usr/") else "/usr" + p)
    for p in candidates:
        r = run(["dpkg-query", "-S", p])
        if r.returncode == 0:
            return r.stdout.split(":", 1)[0].strip()
    return None


def needed_libraries(binary: str) -> dict[str, str | None]:
    """NEEDED sonames of `binary` -> the path the dynamic loader picks (None if unresolved)."""
    sonames = re.findall(r"^\s*NEEDED\s+(\S+)", check(["objdump", "-p", binary]), re.M)
    paths: dict[str, str] = {}
    for line in check(["ldd", binary]).splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line) or re.match(r"\s*(/\S+) \(", line)
        if m:
            paths[os.path.basename(m.group(1))] = m.group(m.lastindex)
    return {s: paths.get(s) for s in sonames}


def depends_names(depends: str) -> set[str]:
    names = set()
    for item in depends.split(","):
        for alt in item.split("|"):
            names.add(alt.strip().split(" ", 1)[0].split(":", 1)[0])
    return names


# ---------------------------------------------------------------- the package, built once
@pytest.fixture(scope="module")
def deb(storefs_bin):
    for tool in ("dpkg-deb", "dpkg-query", "apt-get", "objdump", "readelf", "ldd", "lintian",
                 "unshare"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found on PATH: run scripts/install-deps", pytrace=False)
    out = tempfile.mkdtemp(prefix="storefs-deb-")
    try:
        r = run([BUILD_DEB, "--out", out, "--lint"], timeout=1800)
        assert r.returncode == 0, f"packaging/build-deb failed ({r.returncode}):\n{r.stderr}"
        path = r.stdout.strip().splitlines()[-1]
        # The release build comes from the same sources as the binary under test.
        version = check([storefs_bin, "--version"]).split()[-1]
        arch = check(["dpkg", "--print-architecture"]).strip()
        assert path == os.path.join(out, f"storefs_{version}_{arch}.deb"), (path, r.stderr)
        assert os.path.isfile(path)
        yield path
    finally:
        shutil.rmtree(out, ignore_errors=True)


def toolchain_lib_dir() -> str:
    """The Swift toolchain's usr/lib (where its runtime libraries live), to hide it."""
    swift = shutil.which("swift") or "/opt/swift/usr/bin/swift"
    if not os.path.isfile(swift):
        pytest.fail("swift not found on PATH: the test hides the toolchain's libraries to show "
                    "that the package does not need them", pytrace=False)
    lib = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(swift))), "lib")
    assert os.path.isdir(os.path.join(lib, "swift")), f"no Swift runtime under {lib}"
    return lib


def test_build_deb_binary_option(storefs_bin, tmp_path):
    """--binary packages an existing build; one that loads the toolchain's Swift runtime (the
    debug build scripts/test makes) only with --allow-toolchain-runtime."""
    out = str(tmp_path)
    dynamic = any(TOOLCHAIN_LIB.match(lib) for lib in needed_libraries(storefs_bin))
    if dynamic:
        r = run([BUILD_DEB, "--binary", storefs_bin, "--out", out], timeout=300)
        assert r.returncode != 0, "build-deb packaged a binary that needs the toolchain"
        assert "Swift runtime" in r.stderr and "--static-swift-stdlib" in r.stderr, r.stderr
        assert os.listdir(out) == []
    r = run([BUILD_DEB, "--binary", storefs_bin, "--out", out]
            + (["--allow-toolchain-runtime"] if dynamic else []), timeout=300)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip().splitlines()[-1]
    depends = depends_names(check(["dpkg-deb", "-f", path, "Depends"]))
    assert {"libfuse3-3", "libcurl4", "libssl3", "fuse3"} <= depends, depends
    assert not [d for d in depends if "swift" in d.lower()], depends


def test_contents_and_control(deb, storefs_bin, tmp_path):
    # Files: exactly these, owned by root, with these modes; everything else is a directory.
    listing = check(["dpkg-deb", "-c", deb])
    files = {}
    for line in listing.splitlines():
        mode, owner, _size, _date, _time, name = line.split(None, 5)
        assert owner == "root/root", line
        if not mode.startswith("d"):
            files[name[1:]] = mode   # "./usr/bin/storefs" -> "/usr/bin/storefs"
    assert files == FILES, listing

    fields = {}
    for f in ("Package", "Version", "Architecture", "Maintainer", "Installed-Size", "Depends",
              "Section", "Priority", "Description"):
        fields[f] = check(["dpkg-deb", "-f", deb, f]).strip()
        assert fields[f], f"control field {f} is empty"
    assert fields["Package"] == "storefs"
    assert fields["Version"] == check([storefs_bin, "--version"]).split()[-1]
    assert fields["Architecture"] == check(["dpkg", "--print-architecture"]).strip()
    assert int(fields["Installed-Size"]) > 0

    tree = str(tmp_path / "x")
    check(["dpkg-deb", "-x", deb, tree])
    binary = tree + "/usr/bin/storefs"

    # Depends: every shared library the binary needs comes from a package named in Depends
    # (found here independently of dpkg-shlibdeps); none is the toolchain's, and nothing is
    # looked for next to the binary or in the toolchain (no RUNPATH).
    depends = depends_names(fields["Depends"])
    needed = needed_libraries(binary)
    assert not [lib for lib in needed if TOOLCHAIN_LIB.match(lib)], \
        f"the packaged binary loads the Swift runtime from the toolchain: {sorted(needed)}"
    assert not re.search(r"^\s*(RUNPATH|RPATH)\s", check(["objdump", "-p", binary]), re.M)
    for soname, path in needed.items():
        assert path is not None, f"{soname} does not resolve on this machine"
        pkg = owning_package(path)
        assert pkg is not None, f"no Debian package ships {path} ({soname})"
        assert pkg in depends, f"{soname} comes from {pkg}, missing in Depends: {fields['Depends']}"
    assert {"libfuse3-3", "libcurl4", "libssl3", "libc6", "fuse3", "ca-certificates"} <= depends, \
        fields["Depends"]
    assert not [d for d in depends if "swift" in d.lower()], fields["Depends"]

    # What the files hold.
    assert check([binary, "--version"]).strip() == check([storefs_bin, "--version"]).strip()
    assert ".symtab" not in check(["readelf", "-S", "-W", binary]), "binary is not stripped"
    with gzip.open(tree + "/usr/share/man/man8/storefs.8.gz", "rb") as f, \
            open(os.path.join(ROOT, "man", "storefs.8"), "rb") as g:
        assert f.read() == g.read()
    with open(tree + "/lib/systemd/system/storefs@.service") as f:
        unit = f.read()
    assert re.search(r"^ExecStart=/usr/bin/storefs ", unit, re.M), unit
    assert "/usr/local/bin/storefs" not in unit
    with open(tree + "/usr/share/doc/storefs/copyright") as f:
        assert f.read().startswith("Format: https://www.debian.org/doc/packaging-manuals/"
                                   "copyright-format/1.0/")
    with gzip.open(tree + "/usr/share/doc/storefs/changelog.gz", "rt") as f:
        assert f.readline().startswith(f"storefs ({fields['Version']}) ")


# ---------------------------------------------------------------- install, mount, purge
# Runs under `unshare --mount --propagation private`: what it mounts nobody else sees.
NS_SCRIPT = r"""
set -eu
hide=$1 mnt=$2 opts=$3 out=$4 bucket=$5 file=$6 boot_path=$7
trap 'umount "$mnt" 2>/dev/null || true' EXIT
mount -t tmpfs -o size=64k,mode=0755 storefs-test-hide "$hide"
[ -z "$(ls -A "$hide")" ]
# mount(8) -> /sbin/mount.fuse (fuse3) -> sh -> the storefs on PATH
env -i PATH="$boot_path" LANG=C mount -t fuse.storefs "$bucket" "$mnt" -o "$opts"
awk -v m="$mnt" '$2 == m { print $3 }' /proc/self/mounts >"$out/fstype"
for p in $(pgrep -x storefs || true); do
    if tr '\0' '\n' <"/proc/$p/cmdline" | grep -qxF -- "$mnt"; then
        echo "$p" >>"$out/pids"
        readlink "/proc/$p/exe" >>"$out/exe"
    fi
done
cat "$mnt/$file" >"$out/hello"
umount "$mnt"
"""


def _preconditions() -> None:
    if os.geteuid() != 0:
        pytest.fail("installing the package needs root", pytrace=False)
    if dpkg_knows():
        pytest.fail("a storefs package is already installed (or not purged): this test "
                    "installs and purges its own, so remove it first: "
                    "apt-get remove --purge storefs", pytrace=False)
    if os.path.lexists("/usr/bin/storefs"):
        pytest.fail("/usr/bin/storefs exists but belongs to no storefs package: the package "
                    "would overwrite it and the purge delete it; move it away first",
                    pytrace=False)
    for path in SHADOWS:
        if os.path.lexists(path):
            pytest.fail(f"{path} exists: mount -t fuse.storefs would run it instead of the "
                        "package's /usr/bin/storefs; remove it (packaging/install.sh "
                        "--uninstall) to run this test", pytrace=False)


def test_install_mount_t_and_purge(deb, mount, emulator, corpus):
    _preconditions()
    listed: list[str] = []
    adopted = None
    failure: BaseException | None = None
    try:
        apt_get("install", "--no-install-recommends", "./" + os.path.basename(deb),
                cwd=os.path.dirname(deb))
        assert installed(), "apt-get install succeeded but storefs is not installed"
        listed = check(["dpkg-query", "-L", "storefs"]).split("\n")
        for path in FILES:
            assert path in listed, f"dpkg -L storefs does not list {path}"
            assert os.path.isfile(path), path
        assert check(["/usr/bin/storefs", "--version"]).startswith("storefs ")

        # mount -t, a read and umount in a mount namespace of their own where a tmpfs hides
        # the toolchain's libraries: the installed files alone must do.
        mnt, cache = mount.new_dir("mnt"), mount.new_dir("cache")
        out = mount.new_dir("ns-out")
        adopted = mount.adopt(mnt, cache)
        opts = f"endpoint={emulator.endpoint},anonymous,ca_file={mount.ca_file},cache_dir={cache}"
        r = run(["unshare", "--mount", "--propagation", "private", "bash", "-c", NS_SCRIPT,
                 "ns-script", toolchain_lib_dir(), mnt, opts, out, BUCKET, HELLO, BOOT_PATH],
                timeout=120)

        def out_file(name: str) -> str:
            try:
                with open(os.path.join(out, name)) as f:
                    return f.read()
            except FileNotFoundError:
                return ""

        assert r.returncode == 0, f"mount -t fuse.storefs round trip failed:\n{r.stderr}"
        assert out_file("fstype").strip() == "fuse.storefs", out_file("fstype")
        exes = out_file("exe").split()
        assert exes and set(exes) == {"/usr/bin/storefs"}, f"the mount was served by {exes}"
        with open(os.path.join(out, "hello"), "rb") as f:
            assert f.read() == corpus.data[HELLO]
        for pid in map(int, out_file("pids").split()):
            assert wait_pid_gone(pid, EXIT_TIMEOUT_S), f"storefs pid {pid} still running"
        assert not [p for p in pids_with_arg(mnt) if pid_alive(p)]
    except BaseException as exc:
        failure = exc
        raise
    finally:
        problems = []
        if adopted is not None:   # unmount before the binary goes away, whatever happened
            problems += mount.unmount(adopted)
        if dpkg_knows():
            try:
                apt_get("remove", "--purge", "storefs")
            except AssertionError as exc:
                problems.append(str(exc))
        if dpkg_knows():
            problems.append("dpkg -s storefs still succeeds after apt-get remove --purge")
        ours = set(FILES) | set(OWN_DIRS) | {p for p in listed if "storefs" in p}
        left = sorted(p for p in ours if os.path.lexists(p))
        if left:
            problems.append(f"left after the purge: {left}")
        if problems:
            msg = "package cleanup: " + "; ".join(problems)
            if failure is None:
                pytest.fail(msg, pytrace=False)
            failure.add_note(msg)


# ---------------------------------------------------------------- the systemd unit
UNIT = os.path.join(ROOT, "packaging", "storefs@.service")
# Each of these gives the service a mount namespace of its own, and a FUSE mount made in one
# is invisible to the host: the unit must set none of them.
NAMESPACING = ["PrivateMounts", "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
               "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
               "ProtectControlGroups", "ProtectProc", "ProcSubset", "ReadOnlyPaths",
               "ReadWritePaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths",
               "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "MountFlags",
               "RootDirectory", "RootImage", "PrivateUsers", "PrivateNetwork", "DynamicUser"]
HARDENING = {
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "CAP_SYS_ADMIN",
    "DevicePolicy": "closed",
    "DeviceAllow": "/dev/fuse rw",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "UMask": "0077",
}
# `systemd-analyze security` exposure, on its 0-100 scale (it prints tenths: 5.3); the
# unhardened unit was 96.
EXPOSURE_LIMIT = 60

# Runs under `unshare --mount`: a tmpfs over /usr/local/bin holding the binary under test as
# storefs, so that verify finds the unit's ExecStart (the installed layout) and nothing else
# on the machine changes.
VERIFY_SCRIPT = r"""
set -u
bin=$1 unitdir=$2 limit=$3
mount -t tmpfs -o size=256m,mode=0755 storefs-test-bin /usr/local/bin || exit 90
cp "$bin" /usr/local/bin/storefs || exit 91
cd "$unitdir" || exit 92
systemd-analyze verify --man=no ./storefs@.service >verify.out 2>&1
echo $? >verify.rc
systemd-analyze security --offline=true --threshold="$limit" --no-pager ./storefs@.service \
    >security.out 2>&1
echo $? >security.rc
"""


def unit_settings(text: str) -> dict[str, list[str]]:
    """Key -> values (in order) of the unit file's [Service] section."""
    settings: dict[str, list[str]] = {}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]" and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_service_unit_is_hardened_and_keeps_the_mount_visible(storefs_bin, tmp_path):
    """packaging/storefs@.service (issue 43, item 9): the hardening settings are there, none
    that would hide the mount in a namespace, `systemd-analyze verify` has nothing to say and
    `systemd-analyze security` rates the exposure at most EXPOSURE_LIMIT."""
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze not found: install the Debian package systemd "
                    "(scripts/install-deps does)", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("the unit check mounts a tmpfs in a private namespace: run as root", pytrace=False)
    with open(UNIT) as f:
        unit = f.read()
    settings = unit_settings(unit)
    for key, value in HARDENING.items():
        assert settings.get(key) == [value], f"{key}={value} missing from the unit: {settings.get(key)}"
    nofile = settings.get("LimitNOFILE", [""])[-1]
    assert re.fullmatch(r"\d+(:\d+)?", nofile) and int(nofile.split(":")[0]) >= 4096, \
        f"LimitNOFILE={nofile}: want an explicit limit above systemd's soft 1024"
    hiding = sorted(k for k in settings if k in NAMESPACING)
    assert not hiding, f"these settings put the mount in a private namespace: {hiding}"

    unitdir = tmp_path / "unit"
    unitdir.mkdir()
    shutil.copy(UNIT, unitdir / "storefs@.service")
    r = run(["unshare", "--mount", "--propagation", "private", "bash", "-c", VERIFY_SCRIPT,
             "verify-script", storefs_bin, str(unitdir), str(EXPOSURE_LIMIT)], timeout=120)
    assert r.returncode == 0, f"the verify namespace failed ({r.returncode}): {r.stderr}"
    verify = (unitdir / "verify.out").read_text()
    assert (unitdir / "verify.rc").read_text().strip() == "0" and verify == "", \
        f"systemd-analyze verify:\n{verify}"
    security = (unitdir / "security.out").read_text()
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", security)
    assert m, f"systemd-analyze security gave no exposure level:\n{security[-2000:]}"
    assert (unitdir / "security.rc").read_text().strip() == "0", \
        f"exposure {m.group(1)} is above {EXPOSURE_LIMIT / 10}:\n{security[-3000:]}"
    assert float(m.group(1)) * 10 <= EXPOSURE_LIMIT
