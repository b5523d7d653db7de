"""Issue 47: the Kubernetes manifests in packaging/kubernetes/.

- Every manifest validates against the Kubernetes API schemas (PyPI kubernetes-validate, strict:
  unknown fields fail), for the oldest version the sidecar example needs (1.29: native
  sidecars) and the newest the wheel ships, with no network at all (`unshare --net`): the
  schemas come in the wheel.
- What the schemas cannot see: each storefs container's memory request and limit are its
  memory_limit + 64 MiB (what storefs keeps its resident memory under); its options are ones
  storefs knows; the DaemonSet's mounts go to the host (Bidirectional, privileged) with a cache
  directory per mount under the node's cache volume; readers use HostToContainer; in the
  sidecar example only the mounter is privileged, storefs serves /dev/fd/3 as the user the
  mounter mounts for, and both meet on one socket volume.

Nothing here needs a cluster: docs/kubernetes.md says what does.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANIFESTS = sorted(glob.glob(os.path.join(ROOT, "packaging", "kubernetes", "*.yaml")))
VERSIONS = ["1.29.0", "1.37.0"]
MiB = 1 << 20

try:
    import yaml
except ImportError as exc:   # installed with kubernetes-validate (scripts/python-requirements.txt)
    yaml = None
    YAML_ERROR = exc


def load(name: str) -> list[dict]:
    if yaml is None:
        pytest.fail(f"PyYAML cannot be imported ({YAML_ERROR}); run scripts/install-deps", pytrace=False)
    with open(os.path.join(ROOT, "packaging", "kubernetes", name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"want one {kind}, found {len(found)}"
    return found[0]


def validate(paths: list[str], version: str) -> subprocess.CompletedProcess:
    if shutil.which("unshare") is None:
        pytest.fail("unshare not found (util-linux): the validation runs without network", pytrace=False)
    return subprocess.run(["unshare", "--net", "python3", "-m", "kubernetes_validate", "--strict",
                           "-k", version, *paths], capture_output=True, text=True, timeout=300)


def size(text: str) -> int:
    """storefs's sizes (256M, 1G, 4096) and Kubernetes quantities (320Mi) in bytes."""
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", text)
    assert m, f"not a size: {text!r}"
    scale = {None: 1, "K": 1 << 10, "M": MiB, "G": 1 << 30, "T": 1 << 40,
             "Ki": 1 << 10, "Mi": MiB, "Gi": 1 << 30, "Ti": 1 << 40}[m.group(2)]
    return int(m.group(1)) * scale


def storefs_command(container: dict) -> list[str] | None:
    """The storefs argv a container runs (after storefs-fdpass receive --, or in sh -c), or None."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    if argv[:2] == ["/bin/sh", "-c"]:
        script = " ".join(argv[2:])
        line = next((l.strip() for l in script.splitlines() if l.strip().startswith("exec storefs ")), None)
        return shlex.split(line)[1:] if line else None
    if "storefs" in argv:
        return argv[argv.index("storefs"):]
    return None


def storefs_options(argv: list[str]) -> dict[str, str | None]:
    options: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a == "-o":
            for item in argv[i + 1].split(","):
                key, eq, value = item.partition("=")
                options[key] = value if eq else None
    return options


def containers(pod_spec: dict) -> list[dict]:
    return list(pod_spec.get("initContainers", [])) + list(pod_spec["containers"])


# ---------------------------------------------------------------- schemas
@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_offline_against_the_kubernetes_schemas(version):
    assert {os.path.basename(p) for p in MANIFESTS} >= {"daemonset.yaml", "reader-pod.yaml", "sidecar.yaml"}
    r = validate(MANIFESTS, version)
    assert r.returncode == 0, r.stdout + r.stderr
    passed = re.findall(r"passed for resource (\S+)", r.stdout + r.stderr)
    assert {"daemonset/storefs", "pod/storefs-reader", "deployment/bucket-reader"} <= set(passed), r.stdout


def test_the_validator_rejects_an_unknown_field(tmp_path):
    """The control: the same validation fails on a manifest with one misspelt field."""
    with open(os.path.join(ROOT, "packaging", "kubernetes", "reader-pod.yaml")) as f:
        text = f.read()
    assert "readOnlyRootFilesystem" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("readOnlyRootFilesystem", "readOnlyRootFileSystem"))
    r = validate([str(bad)], VERSIONS[-1])
    assert r.returncode != 0 and "readOnlyRootFileSystem" in r.stdout + r.stderr, r.stdout + r.stderr


# ---------------------------------------------------------------- what the schemas cannot see
def every_storefs_container() -> list[tuple[str, dict, list[str]]]:
    out = []
    for path in MANIFESTS:
        for doc in load(os.path.basename(path)):
            spec = doc.get("spec", {})
            pod = spec.get("template", {}).get("spec") if "template" in spec else (spec if doc["kind"] == "Pod" else None)
            for c in containers(pod) if pod else []:
                argv = storefs_command(c)
                if argv is not None:
                    out.append((f"{os.path.basename(path)}:{c['name']}", c, argv))
    return out


def test_storefs_memory_request_and_limit_are_memory_limit_plus_64_mib():
    found = every_storefs_container()
    assert len(found) >= 3, [f[0] for f in found]
    for where, c, argv in found:
        memory_limit = size(storefs_options(argv).get("memory_limit") or "256M")
        res = c["resources"]
        want = memory_limit + 64 * MiB
        assert size(res["requests"]["memory"]) == want, f"{where}: request {res['requests']['memory']}, want {want // MiB}Mi"
        assert size(res["limits"]["memory"]) == want, f"{where}: limit {res['limits']['memory']}, want {want // MiB}Mi"


def test_storefs_command_lines_in_the_manifests_parse(storefs_bin, tmp_path):
    """storefs itself parses each command line: it gets past its options (status 2 is a bad
    option) to the mount point, which here does not exist."""
    missing = str(tmp_path / "no-such-dir")
    for where, _, argv in every_storefs_container():
        assert argv[1] == "-f", f"{where}: storefs must stay in the foreground in a container"
        args = [a.replace('"$cache"', str(tmp_path)).replace("$cache", str(tmp_path)) for a in argv[1:-1]]
        r = subprocess.run([storefs_bin, *args, missing], capture_output=True, text=True, timeout=60,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        assert r.returncode == 1 and f"mountpoint {missing} does not exist" in r.stderr, f"{where}: {r.stderr}"


def test_daemonset_mounts_reach_the_host_with_a_cache_directory_per_mount():
    ds = one(load("daemonset.yaml"), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    caches, mountpoints = [], []
    for c in pod["containers"]:
        argv = storefs_command(c)
        assert argv is not None, c["name"]
        assert c["securityContext"].get("privileged") is True, c["name"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        mnt_root = next(p for p, m in mounts.items() if m.get("mountPropagation") == "Bidirectional")
        assert "hostPath" in volumes[mounts[mnt_root]["name"]], c["name"]
        script = " ".join(c["args"])
        mnt = re.search(r"mnt=(\S+)", script).group(1)
        cache = re.search(r"cache=(\S+)", script).group(1)
        assert mnt.startswith(mnt_root + "/"), (c["name"], mnt)
        cache_root = next(p for p, m in mounts.items() if volumes[m["name"]].get("hostPath", {}).get("path") == "/var/cache/storefs")
        assert cache.startswith(cache_root + "/"), (c["name"], cache)
        assert storefs_options(argv)["cache_dir"] == "$cache", argv
        assert "allow_other" in storefs_options(argv), c["name"]
        caches.append(cache)
        mountpoints.append(mnt)
    assert len(set(caches)) == len(caches) >= 2, f"one storefs per cache_dir: {caches}"
    assert len(set(mountpoints)) == len(mountpoints)


def test_reader_sees_the_daemonset_mounts_with_host_to_container():
    ds_pod = one(load("daemonset.yaml"), "DaemonSet")["spec"]["template"]["spec"]
    host_dir = next(v["hostPath"]["path"] for v in ds_pod["volumes"] if v["name"] == "mounts")
    reader = one(load("reader-pod.yaml"), "Pod")["spec"]
    vol = next(v for v in reader["volumes"] if v.get("hostPath", {}).get("path") == host_dir)
    for c in reader["containers"]:
        m = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
        assert m["mountPropagation"] == "HostToContainer" and m["readOnly"] is True
        assert not c.get("securityContext", {}).get("privileged")
    assert reader["securityContext"]["runAsNonRoot"] is True


def test_sidecar_only_the_mounter_is_privileged_and_storefs_serves_dev_fd_3():
    docs = load("sidecar.yaml")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in containers(pod)}
    mounter, storefs, app = by_name["fuse-mounter"], by_name["storefs"], by_name["app"]
    # Native sidecars: both run beside the app, the mounter first.
    assert [c["name"] for c in pod["initContainers"]] == ["fuse-mounter", "storefs"]
    assert all(c.get("restartPolicy") == "Always" for c in pod["initContainers"])
    assert mounter["securityContext"]["privileged"] is True
    for c in (storefs, app):
        sc = c["securityContext"]
        assert not sc.get("privileged") and sc["allowPrivilegeEscalation"] is False
        assert sc["runAsNonRoot"] is True and sc["capabilities"]["drop"] == ["ALL"]
    # The mounter mounts for the user storefs runs as, on the socket storefs reads.
    m_argv = mounter["command"]
    assert m_argv[:2] == ["storefs-fdpass", "mount"]
    assert int(m_argv[m_argv.index("--uid") + 1]) == storefs["securityContext"]["runAsUser"]
    assert int(m_argv[m_argv.index("--gid") + 1]) == storefs["securityContext"]["runAsGroup"]
    s_argv = storefs["command"]
    assert s_argv[:2] == ["storefs-fdpass", "receive"]
    socket_path = m_argv[m_argv.index("--socket") + 1]
    assert s_argv[s_argv.index("--socket") + 1] == socket_path
    argv = storefs_command(storefs)
    assert argv[-1] == "/dev/fd/3", argv
    volume_of = lambda c, path: next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/") or path == m["mountPath"])
    assert volume_of(mounter, socket_path)["name"] == volume_of(storefs, socket_path)["name"]
    # The mount point: Bidirectional from the mounter, HostToContainer for the others.
    mnt = m_argv[-1]
    bucket = volume_of(mounter, mnt)
    assert bucket["mountPropagation"] == "Bidirectional"
    for c in (storefs, app):
        m = next(m for m in c["volumeMounts"] if m["name"] == bucket["name"])
        assert m["mountPropagation"] == "HostToContainer" and m["readOnly"] is True
    # Credentials: Workload Identity through the pod's service account (no key, no token).
    sa = one(docs, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert "iam.gke.io/gcp-service-account" in sa["metadata"]["annotations"]
    assert not {"credentials", "token_file", "anonymous"} & set(storefs_options(argv))
