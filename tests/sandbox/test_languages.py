"""Every sandbox language through SandboxFusion's own client (``sandbox-fusion`` from PyPI) against
``agentrl sandbox serve --backend {local,docker}`` (the real CLI, in its own process): a hello-world, a compile error, a
runtime error, a time limit and a stdin program each get SandboxFusion's field values back. A language whose
toolchain is not installed here (or not in the Docker image) is skipped, naming its Debian package; one the
sandbox lacks answers ``SandboxError`` naming the package."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import sandbox_fusion
from language_programs import COMPILED, PROGRAMS, REQUIRED, language_param
from sandbox_fusion import RunCodeRequest, RunCodeResponse
from sandbox_support import ServerHandle, require_docker

from agentrl.sandbox import languages
from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunStatus
from agentrl.sandbox.languages import LANGUAGE_TABLE
from agentrl.sandbox.local import LocalSandbox
from agentrl.sandbox.server import create_app

ROOT = Path(__file__).resolve().parents[2]
LANGS = [language_param(name) for name in PROGRAMS]
TLE_S = 1.5


@dataclass
class Served:
    url: str
    backend: str
    image_tools: frozenset[str] | None  # docker: the executables its image has

    def need(self, language: str) -> None:
        """Skip when the Docker image lacks the language's toolchain (the host's is checked by LANGS)."""
        lang = LANGUAGE_TABLE[language]
        if self.image_tools is not None and not set(lang.tools) <= self.image_tools:
            if language in REQUIRED:
                pytest.fail(f"the Docker image has no {language} toolchain: rebuild it with "
                            "scripts/build_sandbox_image.sh (its default image has g++ and nodejs)")
            pytest.skip(f"the Docker image has no {language} toolchain (build it with "
                        f"AGENTRL_SANDBOX_PACKAGES={lang.package} scripts/build_sandbox_image.sh)")


def image_tools(image: str) -> frozenset[str]:
    import docker

    tools = sorted({t for lang in LANGUAGE_TABLE.values() for t in lang.tools})
    client = docker.from_env()
    try:
        out = client.containers.run(image, ["sh", "-c", "for t in " + " ".join(tools) + "; do command -v $t; done; true"],
                                    remove=True, network_mode="none")
    finally:
        client.close()
    return frozenset(Path(line).name for line in out.decode().split())


@pytest.fixture(scope="module", params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def server(request: pytest.FixtureRequest) -> Iterator[Served]:
    """``agentrl sandbox serve --backend BACKEND`` on a free port, as a user starts it."""
    backend = request.param
    tools = None
    if backend == "docker":
        require_docker()
        from agentrl.sandbox.docker import DEFAULT_IMAGE

        tools = image_tools(DEFAULT_IMAGE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", "from agentrl.cli import app; app()", "sandbox", "serve",
                             "--backend", backend, "--port", str(port), "--max-concurrency", "2"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if requests.get(url + "/v1/ping", timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"the sandbox server exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            time.sleep(0.1)
        else:
            raise RuntimeError("the sandbox server did not answer within 60s")
        yield Served(url, backend, tools)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def server_url(server: Served, language: str) -> str:
    server.need(language)
    return server.url


def fusion_run(url: str, language: str, code: str, **fields: Any) -> RunCodeResponse:
    """SandboxFusion's client, except for ``c``: its client's ``Language`` type has no ``c`` (SandboxFusion has
    no C), so that one is posted as raw JSON and parsed with the client's response model."""
    if language == "c":
        resp = requests.post(url + "/run_code", json={"code": code, "language": "c", **fields}, timeout=120)
        resp.raise_for_status()
        return RunCodeResponse(**resp.json())
    return sandbox_fusion.run_code(RunCodeRequest(code=code, language=language, **fields), endpoint=url,
                                   max_attempts=1, client_timeout=120)


@pytest.mark.parametrize("language", LANGS)
def test_hello_world(server_url: str, language: str) -> None:
    r = fusion_run(server_url, language, PROGRAMS[language]["hello"], compile_timeout=60)
    assert r.status == "Success", r
    assert (r.run_result.status, r.run_result.return_code, r.run_result.stdout) == ("Finished", 0, "hello\n"), r
    if language in COMPILED:
        assert (r.compile_result.status, r.compile_result.return_code) == ("Finished", 0), r
        assert r.compile_result.execution_time > 0
    else:
        assert r.compile_result is None


@pytest.mark.parametrize("language", LANGS)
def test_compile_error_is_the_programs_failure(server_url: str, language: str) -> None:
    r = fusion_run(server_url, language, PROGRAMS[language]["compile_error"], compile_timeout=60)
    assert r.status == "Failed", r  # never SandboxError (the client would have raised)
    if language in COMPILED:
        assert r.run_result is None, r  # nothing ran
        assert r.compile_result.status == "Finished" and r.compile_result.return_code != 0, r
        assert r.compile_result.stderr or r.compile_result.stdout, r  # the compiler's diagnostics
    else:  # an interpreted language finds it when it runs
        assert r.compile_result is None, r
        assert r.run_result.status == "Finished" and r.run_result.return_code != 0 and r.run_result.stderr, r


@pytest.mark.parametrize("language", LANGS)
def test_runtime_error(server_url: str, language: str) -> None:
    r = fusion_run(server_url, language, PROGRAMS[language]["runtime_error"], compile_timeout=60)
    assert r.status == "Failed", r
    assert r.run_result.status == "Finished" and r.run_result.return_code not in (0, None), r
    if language in COMPILED:
        assert r.compile_result.return_code == 0, r


@pytest.mark.parametrize("language", LANGS)
def test_time_limit(server_url: str, language: str) -> None:
    r = fusion_run(server_url, language, PROGRAMS[language]["loop"], compile_timeout=60, run_timeout=TLE_S)
    assert r.status == "Failed", r
    assert r.run_result.status == "TimeLimitExceeded", r
    if language in COMPILED:
        assert (r.compile_result.status, r.compile_result.return_code) == ("Finished", 0), r


@pytest.mark.parametrize("language", LANGS)
def test_stdin(server_url: str, language: str) -> None:
    r = fusion_run(server_url, language, PROGRAMS[language]["stdin"], compile_timeout=60, stdin="40 2\n")
    assert r.status == "Success", r
    assert r.run_result.stdout == "42\n", r


@pytest.mark.parametrize("language", [language_param("cpp")])
def test_compile_time_limit_is_its_own(server_url: str, language: str) -> None:
    """A compile step past compile_timeout is TimeLimitExceeded in compile_result, and nothing runs."""
    heavy = "\n".join(
        ["template<int N> struct F { static const long v = F<N - 1>::v + F<N - 2>::v; };",
         "template<> struct F<1> { static const long v = 1; };",
         "template<> struct F<0> { static const long v = 0; };",
         "#include <cstdio>",
         *[f"template<int N> struct G{i} {{ static const long v = G{i}<N - 1>::v * 3 + F<(N % 40)>::v; }};"
           f"\ntemplate<> struct G{i}<0> {{ static const long v = {i}; }};" for i in range(400)],
         "int main() { long s = 0;",
         *[f"  s += G{i}<800>::v;" for i in range(400)],
         "  std::printf(\"%ld\\n\", s); }"])
    r = fusion_run(server_url, "cpp", heavy, compile_timeout=0.5, run_timeout=5)
    assert r.status == "Failed" and r.run_result is None, r
    assert r.compile_result.status == "TimeLimitExceeded", r


@pytest.mark.parametrize("language", [language_param("cpp")])
def test_files_and_fetch_files_with_a_compiled_language(server_url: str, language: str) -> None:
    code = ('#include <fstream>\n#include <string>\nint main() { std::ifstream in("in.txt"); std::string s; in >> s;'
            ' std::ofstream("out.txt") << s << s; }')
    r = fusion_run(server_url, "cpp", code, files={"in.txt": base64.b64encode(b"ab").decode()},
                   fetch_files=["out.txt", "main"])
    assert r.status == "Success", r
    assert base64.b64decode(r.files["out.txt"]) == b"abab"
    assert base64.b64decode(r.files["main"])[:4] == b"\x7fELF"  # the build output lives in the run's scratch


def test_an_unknown_language_is_a_clear_4xx(server: Served) -> None:
    resp = requests.post(server.url + "/run_code", json={"code": "1", "language": "cobol"}, timeout=30)
    assert resp.status_code == 400
    assert "cobol" in resp.text and "cpp" in resp.text and "typescript" in resp.text


async def test_a_missing_toolchain_names_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox lacks the language's compiler: a SandboxError naming the Debian package, before anything
    runs; SandboxFusion's client raises it (as it does for every SandboxError); the sandbox stays usable."""
    table = dict(languages.LANGUAGE_TABLE)
    table["go"] = languages.Language("go", "golang-go", "main.go", ("./main",), ("go-not-here", "build"),
                                     tools=("go-not-here",))
    monkeypatch.setattr("agentrl.sandbox._wire.LANGUAGE_TABLE", table)
    monkeypatch.setattr("agentrl.sandbox._core.LANGUAGE_TABLE", table)
    async with LocalSandbox(max_concurrency=1, pool_size=1) as sb:
        r = await sb.run(RunRequest(PROGRAMS["go"]["hello"], language="go"))
        assert r.status is RequestStatus.SANDBOX_ERROR and r.run_status is None, r
        assert "golang-go" in r.message and "go-not-here" in r.message, r
        handle = await ServerHandle(create_app(sb)).start()
        try:
            with pytest.raises(Exception, match="golang-go"):
                await asyncio_to_thread(fusion_run, handle.url, "go", PROGRAMS["go"]["hello"])
        finally:
            await handle.stop()
        ok = await sb.run(RunRequest("print('ok')"))
        assert (ok.status, ok.stdout) == (RequestStatus.SUCCESS, "ok\n"), ok


async def asyncio_to_thread(fn: Any, *args: Any) -> Any:
    import asyncio

    return await asyncio.to_thread(fn, *args)


async def test_cases_compile_once_and_run_per_case() -> None:
    """A request with cases: one compile, one run per stdin, each with its own time limit."""
    code = ('#include <iostream>\n#include <unistd.h>\nint main() { long a, b; std::cin >> a >> b;'
            ' if (a < 0) { for (;;) {} } if (a == 7) return 3; std::cout << a + b << "\\n"; }')
    lim = Limits(time_s=1.0)
    async with LocalSandbox(max_concurrency=1, pool_size=1) as sb:
        r = await sb.run(RunRequest(code, language="cpp", cases=("1 2", "-1 0", "7 0", "40 2"), limits=lim,
                                    total_time_s=20))
    assert r.compile is not None and r.compile.ok, r
    assert [c.run_status for c in r.cases] == [RunStatus.FINISHED, RunStatus.TIME_LIMIT_EXCEEDED, RunStatus.ERROR,
                                               RunStatus.FINISHED], r
    assert (r.cases[0].stdout, r.cases[2].exit_code, r.cases[3].stdout) == ("3\n", 3, "42\n")
    assert r.status is RequestStatus.FAILED and "case 1" in r.message


@pytest.mark.parametrize("language", [language_param("cpp")])
def test_cli_runs_a_program_by_its_suffix(tmp_path: Path, language: str) -> None:
    from typer.testing import CliRunner

    from agentrl.sandbox.cli import sandbox_app

    program = tmp_path / "prog.cpp"
    program.write_text('#include <iostream>\nint main() { std::string s; std::cin >> s; std::cout << "got " << s '
                       '<< std::endl; return 4; }')
    result = CliRunner().invoke(sandbox_app, ["run", str(program)], input="piped")
    assert (result.exit_code, result.stdout) == (4, "got piped\n"), result.output
    broken = tmp_path / "broken.cpp"
    broken.write_text("int main() { return undeclared; }")
    result = CliRunner().invoke(sandbox_app, ["run", str(broken)])
    assert result.exit_code == 1 and "undeclared" in result.output and "did not compile" in result.output
    unknown = tmp_path / "prog.cob"
    unknown.write_text("DISPLAY 'x'.")
    result = CliRunner().invoke(sandbox_app, ["run", str(unknown)])
    assert result.exit_code == 2 and ".cpp" in result.output
