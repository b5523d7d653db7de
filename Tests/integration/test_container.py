"""Issue 47: the container image of packaging/container/, built with podman and run with
/dev/fuse.

- The image is what packaging/container/build-image makes of the real .deb (packaging/build-deb,
  the release build test_package.py also makes, incremental in .build/deb). Its base: no
  registry but Debian's and PyPI is reachable here, so debian:12-slim cannot be pulled; the
  test builds Debian 12 itself with mmdebstrap (--variant=minbase, from Debian's packages) and
  passes it as --base. Everything else is the Containerfile as users build it.
- podman runs with a private store under /var/tmp (nothing of the machine's is touched), runc
  (crun refuses this machine's hybrid cgroups) and ulimits no higher than the caller's (podman
  would raise them, which needs CAP_SYS_RESOURCE): docs/kubernetes.md, "What was validated here".
- By default the image runs storefs, as a non-root user, in the foreground.
- `podman run --preserve-fds 1 IMAGE ... /dev/fd/3` serves a connection the test mounted.
- The sidecar example's two containers, as podman containers: storefs-fdpass mount in a
  privileged one (its mount point a shared bind of a host directory: Bidirectional),
  storefs-fdpass receive + storefs in an unprivileged one; the host reads the bucket through
  the mount, and stopping the mounter ends storefs with status 0.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
import uuid

import pytest

from storefs_testlib import (BUCKET, EXIT_TIMEOUT_S, MOUNT_TIMEOUT_S, expected_tree, fuse_mount,
                             is_mounted, mount_at, read_whole)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTAINER = os.path.join(ROOT, "packaging", "container")
BUILD_IMAGE = os.path.join(CONTAINER, "build-image")
IMAGE_UID = 65532
SAMPLE = ["files/hello.txt", "files/lines.txt", "big/random-24MiB.bin", "enc/compressed.txt.gz",
          "odd/with space.txt", "odd/ünïcødé-日本.txt", "implicit/deep/file.txt"]


def run(argv, timeout=600, check=True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, **kw)
    if check:
        assert r.returncode == 0, f"{' '.join(argv)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


class Podman:
    """podman with a store of its own; `run_options` for every container it starts."""

    def __init__(self, top: str) -> None:
        self.top = top
        self.global_options = [f"--root={top}/root", f"--runroot={top}/run", "--runtime=runc",
                               "--cgroup-manager=cgroupfs", "--events-backend=file"]
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        # podman lowers its own RLIMIT_NPROC to 32768 before starting the runtime.
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
        self.run_options = [f"--ulimit=nofile={nofile}:{nofile}", f"--ulimit=nproc={nproc}:{nproc}"]

    def __call__(self, *args: str, timeout=600, check=True, **kw) -> subprocess.CompletedProcess:
        return run(["podman", *self.global_options, *args], timeout=timeout, check=check, **kw)

    def argv(self, *args: str) -> list[str]:
        return ["podman", *self.global_options, *args]

    def close(self) -> None:
        self("rm", "--all", "--force", "--time=0", check=False, timeout=120)
        self("rmi", "--all", "--force", check=False, timeout=120)
        # Layers podman left mounted (a crash mid-test) before the store goes.
        with open("/proc/self/mountinfo") as f:
            leftovers = [l.split(" ")[4] for l in f if l.split(" ")[4].startswith(self.top)]
        for path in reversed(leftovers):
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
        shutil.rmtree(self.top, ignore_errors=True)


@pytest.fixture(scope="module")
def podman():
    for tool in ("podman", "runc", "mmdebstrap", "dpkg-deb"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: run scripts/install-deps (the image test needs podman, runc, mmdebstrap)",
                        pytrace=False)
    if os.getuid() != 0:
        pytest.fail("the image test runs podman as root and mounts /dev/fuse: run it as root", pytrace=False)
    p = Podman(tempfile.mkdtemp(prefix="storefs-podman-", dir="/var/tmp"))
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def image(podman, storefs_bin):
    work = os.path.join(podman.top, "work")
    os.mkdir(work)
    r = run([os.path.join(ROOT, "packaging", "build-deb"), "--out", work], timeout=1800)
    deb = r.stdout.strip().splitlines()[-1]
    base_tar = os.path.join(work, "bookworm.tar")
    run(["mmdebstrap", "--quiet", "--variant=minbase", "--mode=root", "bookworm", base_tar], timeout=900)
    base = "localhost/storefs-test-base:bookworm"
    podman("import", base_tar, base, timeout=300)
    os.unlink(base_tar)
    tag = f"localhost/storefs-test:{uuid.uuid4().hex[:8]}"
    r = run([BUILD_IMAGE, "--deb", deb, "--base", base, "--tag", tag,
             *[f"--tool-option={o}" for o in podman.global_options], "--", "--network=host",
             *podman.run_options], timeout=900)
    assert r.stdout.strip().splitlines()[-1] == tag, r.stdout + r.stderr
    version = run([storefs_bin, "--version"]).stdout.strip()
    return tag, version


@pytest.fixture
def place(tls):
    """A 0755 directory in /tmp: `mnt` (the mount point), `ca` (a 0644 copy of the session CA,
    which the image's user reads), `sock` (the socket directory of the sidecar pair)."""
    top = tempfile.mkdtemp(prefix="storefs-image-", dir="/tmp")
    os.chmod(top, 0o755)
    ns = type("Place", (), {})()
    ns.top, ns.mnt, ns.sock = top, os.path.join(top, "mnt"), os.path.join(top, "sock")
    os.mkdir(ns.mnt)
    os.mkdir(ns.sock, 0o755)
    ns.ca = os.path.join(top, "ca.pem")
    shutil.copyfile(tls.ca_file, ns.ca)
    os.chmod(ns.ca, 0o644)
    try:
        yield ns
    finally:
        while is_mounted(ns.mnt):
            if subprocess.run(["umount", "-l", ns.mnt], capture_output=True, timeout=30).returncode != 0:
                break
        shutil.rmtree(top, ignore_errors=True)


def storefs_options(emulator) -> str:
    return f"endpoint={emulator.endpoint},anonymous,ca_file=/etc/storefs/ca.pem"


def wait_listing(mnt: str, alive, what: str) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while True:
        problem = alive()
        if problem:
            pytest.fail(f"{what} ended before the mount was served: {problem}", pytrace=False)
        try:
            if is_mounted(mnt) and os.listdir(mnt):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{mnt} not served within {MOUNT_TIMEOUT_S:.0f} s by {what}", pytrace=False)
        time.sleep(0.1)


def check_sample(mnt: str, corpus) -> None:
    dirs, _ = expected_tree(corpus.data)
    assert set(os.listdir(mnt)) == dirs[""]
    for name in SAMPLE:
        assert read_whole(os.path.join(mnt, name)) == corpus.data[name], name


# ---------------------------------------------------------------- the image
def test_containerfile_installs_the_deb_on_debian_12_slim_as_a_non_root_user():
    """The recipe's structure, as users build it (the base the test uses differs: see above)."""
    with open(os.path.join(CONTAINER, "Containerfile")) as f:
        lines = [l.strip() for l in f if l.strip() and not l.lstrip().startswith("#")]
    text = "\n".join(lines)
    assert lines[0] == "ARG BASE=docker.io/library/debian:12-slim" and lines[1] == "FROM ${BASE}"
    assert "COPY storefs_*.deb /tmp/" in lines
    assert "apt-get install -y --no-install-recommends /tmp/storefs_*.deb" in text
    users = [l for l in lines if l.startswith("USER ")]
    assert users == [f"USER {IMAGE_UID}:{IMAGE_UID}"], users
    assert lines[-2:] == ['ENTRYPOINT ["/usr/bin/storefs", "-f"]', 'CMD ["--help"]']


def test_image_runs_storefs_as_a_non_root_user_by_default(podman, image):
    tag, version = image
    config = json.loads(podman("image", "inspect", tag).stdout)[0]["Config"]
    assert config["User"] == f"{IMAGE_UID}:{IMAGE_UID}"
    assert config["Entrypoint"] == ["/usr/bin/storefs", "-f"]
    r = podman("run", "--rm", "--network=none", *podman.run_options, tag, "--version")
    assert r.stdout.strip() == version
    r = podman("run", "--rm", "--network=none", *podman.run_options, "--entrypoint", "id", tag)
    assert r.stdout.startswith(f"uid={IMAGE_UID}(storefs) gid={IMAGE_UID}(storefs)"), r.stdout
    # The toolchain's runtime is not in the image: the package's binary stands alone.
    r = podman("run", "--rm", "--network=none", *podman.run_options, "--entrypoint", "sh", tag, "-c",
               "ldd /usr/bin/storefs; for c in storefs-fdpass python3 mount fusermount3; do command -v $c; done")
    assert "not found" not in r.stdout and "libswift" not in r.stdout, r.stdout
    found = r.stdout.splitlines()[-4:]
    assert found == ["/usr/local/bin/storefs-fdpass", "/usr/bin/python3", "/usr/bin/mount", "/usr/bin/fusermount3"], r.stdout


def test_image_serves_a_connection_the_host_mounted(podman, image, emulator, corpus, place):
    """`podman run --preserve-fds 1 IMAGE ... /dev/fd/3`, the image's default user and
    entrypoint: the test mounts /dev/fuse for uid 65532 and hands the descriptor in."""
    tag, _ = image
    fd = fuse_mount(place.mnt, IMAGE_UID, IMAGE_UID)
    argv = podman.argv("run", "--rm", "--network=host", "--preserve-fds=1", *podman.run_options,
                       "-v", f"{place.ca}:/etc/storefs/ca.pem:ro", tag,
                       "-o", storefs_options(emulator), BUCKET, "/dev/fd/3")
    log = os.path.join(place.top, "podman.log")
    proc = None
    try:
        with open(log, "wb") as out:
            # The descriptor becomes podman's 3, which --preserve-fds passes on as the container's 3.
            proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{fd}', "bash", *argv], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=out, pass_fds=(fd,), start_new_session=True)
        os.close(fd)
        fd = -1
        wait_listing(place.mnt, lambda: proc.poll() is not None and open(log).read(), "the container")
        check_sample(place.mnt, corpus)
        assert run(["umount", place.mnt]).returncode == 0
        try:
            rc = proc.wait(timeout=EXIT_TIMEOUT_S + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the container still runs after the unmount:\n{open(log).read()}")
        assert rc == 0, open(log).read()
    finally:
        if fd >= 0:
            os.close(fd)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_image_sidecar_pair_mounts_privileged_and_serves_unprivileged(podman, image, emulator, corpus, place):
    """packaging/kubernetes/sidecar.yaml's fuse-mounter and storefs containers, run by podman:
    the mount point is a shared bind of a host directory (what Bidirectional gives), the
    socket directory is shared (the emptyDir), storefs runs as the image's user with no
    capabilities and a read-only root, its cache on a volume; the host reads the bucket."""
    tag, _ = image
    run(["mount", "--bind", place.mnt, place.mnt])
    run(["mount", "--make-shared", place.mnt])
    names = [f"storefs-test-mounter-{uuid.uuid4().hex[:6]}", f"storefs-test-serve-{uuid.uuid4().hex[:6]}"]
    try:
        podman("run", "-d", "--name", names[0], "--privileged", "--user=0:0", "--network=none",
               *podman.run_options, "-v", f"{place.sock}:/run/storefs",
               "-v", f"{place.mnt}:/mnt/bucket:rshared", "--entrypoint", "storefs-fdpass", tag,
               "mount", "--socket", "/run/storefs/fd.sock", "--uid", str(IMAGE_UID), "--gid", str(IMAGE_UID),
               "--allow-other", "/mnt/bucket")
        # As sidecar.yaml runs it: no capabilities, a read-only root, the cache on a volume.
        cache = os.path.join(place.top, "cache")
        os.mkdir(cache, 0o700)
        os.chown(cache, IMAGE_UID, IMAGE_UID)
        podman("run", "-d", "--name", names[1], "--network=host", "--cap-drop=all", "--read-only",
               "--security-opt=no-new-privileges", *podman.run_options, "-v", f"{place.sock}:/run/storefs",
               "-v", f"{cache}:/var/cache/storefs", "-v", f"{place.ca}:/etc/storefs/ca.pem:ro",
               "--entrypoint", "storefs-fdpass", tag,
               "receive", "--socket", "/run/storefs/fd.sock", "--", "storefs", "-f", "-o",
               storefs_options(emulator) + ",cache_dir=/var/cache/storefs/bucket", BUCKET, "/dev/fd/3")

        def ended() -> str:
            states = [podman("inspect", "--format", "{{.State.Status}}", n).stdout.strip() for n in names]
            if any(s != "running" for s in states):
                return f"states {states}\n" + "\n".join(podman("logs", n, check=False).stderr for n in names)
            return ""

        wait_listing(place.mnt, ended, "the sidecar pair")
        entry = mount_at(place.mnt)
        assert entry is not None and entry[1] == "fuse.storefs", entry
        check_sample(place.mnt, corpus)
        assert os.path.isdir(os.path.join(cache, "bucket", "v1")), os.listdir(cache)
        # Pod shutdown: the mounter unmounts on SIGTERM; storefs sees its connection end.
        podman("stop", "--time=20", names[0], timeout=60)
        rc = podman("wait", names[1], timeout=EXIT_TIMEOUT_S + 30).stdout.strip()
        assert rc == "0", "\n".join(podman("logs", n, check=False).stderr for n in names)
        mounts = [e for e in open("/proc/self/mountinfo") if " fuse.storefs " in e and place.top in e]
        assert not mounts, mounts
    finally:
        for n in names:
            podman("rm", "--force", "--time=0", n, check=False, timeout=120)
