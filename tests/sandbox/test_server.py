"""The sandbox server over real HTTP (uvicorn on a free port, local backend): SandboxFusion's wire format,
auth, admission (429), the load /v1/ping reports, sessions, health through hostile programs; the RemoteSandbox
client's retries; the CLI."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sandbox_support import ServerHandle

from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, RunStatus
from agentrl.sandbox.local import LocalSandbox
from agentrl.sandbox.remote import RemoteSandbox
from agentrl.sandbox.server import create_app

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
async def local() -> AsyncIterator[LocalSandbox]:
    async with LocalSandbox(max_concurrency=4) as sb:
        yield sb


@pytest.fixture(scope="module")
async def server(local: LocalSandbox) -> AsyncIterator[ServerHandle]:
    handle = await ServerHandle(create_app(local, max_concurrency=4, max_queue=64, token=TOKEN,
                                           max_output_bytes=2000, max_body_bytes=1 << 20)).start()
    yield handle
    await handle.stop()


async def post(url: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers or AUTH) as resp:
        return resp.status, await resp.json()


async def test_run_code_speaks_sandboxfusion(server: ServerHandle) -> None:
    status, body = await post(server.url + "/run_code", {"code": "print(input())", "language": "python",
                                                         "stdin": "hi"})
    assert status == 200
    assert set(body) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert set(body["run_result"]) == {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert (body["status"], body["run_result"]["status"], body["run_result"]["stdout"]) == \
        ("Success", "Finished", "hi\n")
    _, body = await post(server.url + "/run_code", {"code": "exit 3", "language": "bash"})
    assert (body["status"], body["run_result"]["status"], body["run_result"]["return_code"]) == \
        ("Failed", "Finished", 3)
    _, body = await post(server.url + "/run_code", {"code": "while True: pass", "language": "python",
                                                    "run_timeout": 1, "memory_limit_MB": 128})
    assert (body["status"], body["run_result"]["status"]) == ("Failed", "TimeLimitExceeded")
    files = {"a.txt": base64.b64encode(b"xyz").decode()}
    _, body = await post(server.url + "/run_code", {"code": "open('b.txt','w').write(open('a.txt').read()*2)",
                                                    "language": "python", "files": files,
                                                    "fetch_files": ["b.txt"]})
    assert base64.b64decode(body["files"]["b.txt"]) == b"xyzxyz"
    _, body = await post(server.url + "/run_code", {"code": "print('x' * 5000)", "language": "python"})
    assert "output truncated" in body["run_result"]["stdout"]  # the server's max_output_bytes
    status, _ = await post(server.url + "/run_code", {"code": "1", "language": "cobol"})
    assert status == 400


async def test_run_jupyter_speaks_sandboxfusion(server: ServerHandle) -> None:
    cells = ["a = 123", "a", "print(a)", "import sys; sys.stderr.write('stderr message')",
             "raise RuntimeError('error message')", "print(open('in.txt').read()); open('out.txt', 'w').write('o')"]
    status, body = await post(server.url + "/run_jupyter", {
        "cells": cells, "files": {"in.txt": base64.b64encode(b"given").decode()}, "fetch_files": ["out.txt"]})
    assert status == 200 and body["status"] == "Success", body
    c = body["cells"]
    assert set(c[0]) == {"stdout", "stderr", "display", "error"}
    assert c[1]["display"] == [{"text/plain": "123"}]
    assert c[2]["stdout"] == "123\n" and c[3]["stderr"] == "stderr message"
    assert c[4]["error"][0]["ename"] == "RuntimeError" and c[4]["error"][0]["evalue"] == "error message"
    assert c[5]["stdout"] == "given\n" and base64.b64decode(body["files"]["out.txt"]) == b"o"
    _, body = await post(server.url + "/run_jupyter", {"cells": ["import time; time.sleep(30)"], "cell_timeout": 1})
    assert body["status"] == "Failed" and body["driver"]["status"] == "TimeLimitExceeded"


async def test_auth_and_body_cap(server: ServerHandle) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/v1/ping") as resp:
            assert (resp.status, await resp.json()) == (200, "pong")
        async with http.post(server.url + "/run_code", json={"code": "1", "language": "python"}) as resp:
            assert resp.status == 401
        big = {"code": "#" + "x" * (2 << 20), "language": "python"}
        async with http.post(server.url + "/run_code", json=big, headers=AUTH) as resp:
            assert resp.status == 413


async def test_sessions_over_http(server: ServerHandle) -> None:
    async with RemoteSandbox(server.url, token=TOKEN) as remote:
        s = await remote.session("python", Limits(time_s=5))
        assert (await s.run("k = 'v'")).status is RequestStatus.SUCCESS
        assert (await s.run("print(k)")).stdout == "v\n"
        await s.aclose()
        assert (await s.run("print(k)")).is_sandbox_error
    status, _ = await post(server.url + "/v1/sessions/nope/run", {"code": "1"})
    assert status == 404


class Announcing:
    """A sandbox that sets ``running`` when a run begins (the server's slot is held from then on)."""

    def __init__(self, inner: LocalSandbox) -> None:
        self.inner, self.running = inner, asyncio.Event()

    async def run(self, request: RunRequest) -> RunResult:
        self.running.set()
        return await self.inner.run(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_full_server_answers_429_and_the_client_retries(local: LocalSandbox) -> None:
    sandbox = Announcing(local)
    handle = await ServerHandle(create_app(sandbox, max_concurrency=1, max_queue=0)).start()  # type: ignore[arg-type]
    try:
        slow = {"code": "import time; time.sleep(1.5)", "language": "python"}
        first = asyncio.ensure_future(post(handle.url + "/run_code", slow))
        await asyncio.wait_for(sandbox.running.wait(), 30)
        status, body = await post(handle.url + "/run_code", {"code": "print(1)", "language": "python"})
        assert status == 429, body
        async with RemoteSandbox(handle.url, retries=8, backoff_s=0.2) as remote:
            r = await remote.run(RunRequest(code="print('after retries')"))
        assert r.stdout == "after retries\n", r
        assert (await first)[1]["status"] == "Success"
    finally:
        await handle.stop()


async def test_unreachable_server_is_a_sandbox_error() -> None:
    async with RemoteSandbox("http://127.0.0.1:9", retries=1, backoff_s=0.01) as remote:
        r = await remote.run(RunRequest(code="print(1)"))
    assert r.is_sandbox_error and "cannot connect" in r.message


async def test_server_stays_healthy_through_hostile_programs(server: ServerHandle) -> None:
    async with RemoteSandbox(server.url, token=TOKEN) as remote:
        probe = ("import subprocess\nps = []\ntry:\n    for i in range(40):\n"
                 "        ps.append(subprocess.Popen(['sleep', '5']))\nexcept OSError:\n    pass\nprint(len(ps))\n"
                 "for p in ps: p.kill()")
        r = await remote.run(RunRequest(code=probe, limits=Limits(time_s=5, pids=12)))
        assert 0 < int(r.stdout) <= 12, r  # the pids limit holds before any bomb is sent
        hostile = [
            RunRequest(code="import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
                       limits=Limits(time_s=2, pids=32)),
            RunRequest(code="x = []\nwhile True: x.append(bytearray(1 << 24))", limits=Limits(time_s=5, memory_mb=128)),
            RunRequest(code="import sys\nwhile True: sys.stdout.write('z' * 65536)", limits=Limits(time_s=1.5)),
            RunRequest(code="while True: pass", limits=Limits(time_s=1)),
        ]
        results = await asyncio.gather(*(remote.run(h) for h in hostile))
        assert all(r.status is RequestStatus.FAILED for r in results), results
        assert await remote.ping()
        r = await remote.run(RunRequest(code="print('still fine')"))
        assert (r.run_status, r.stdout) == (RunStatus.FINISHED, "still fine\n")


def test_cli_run(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agentrl.sandbox.cli import sandbox_app

    program = tmp_path / "prog.py"
    program.write_text("import sys\nprint('from the sandbox', sys.stdin.read().strip())\nsys.exit(5)")
    result = CliRunner().invoke(sandbox_app, ["run", str(program), "--backend", "local"], input="piped")
    assert result.exit_code == 5, result.output
    assert "from the sandbox piped" in result.output


def test_cli_serve_refuses_the_remote_backend_with_what_it_takes() -> None:
    from typer.testing import CliRunner

    from agentrl.sandbox.cli import sandbox_app

    result = CliRunner().invoke(sandbox_app, ["serve", "--backend", "remote"])
    assert result.exit_code == 2, result.output
    assert "local, docker or auto" in result.output and "--backend" in result.output


async def test_ping_reports_running_and_queued_requests(local: LocalSandbox) -> None:
    from agentrl.sandbox.schemas import ServerLoad

    handle = await ServerHandle(create_app(local, max_concurrency=1, max_queue=4)).start()
    try:
        async with RemoteSandbox(handle.url) as remote:
            assert await remote.load() == ServerLoad(running=0, queued=0, capacity=1, sessions=0)
            slow = RunRequest(code="import time; time.sleep(1.0)")
            runs = [asyncio.ensure_future(remote.run(slow)) for _ in range(2)]
            async with asyncio.timeout(30):
                while (load := await remote.load()) != ServerLoad(running=1, queued=1, capacity=1):
                    assert load is not None and load.busy <= 2, load
                    await asyncio.sleep(0.02)
            assert all(r.status is RequestStatus.SUCCESS for r in await asyncio.gather(*runs))
            s = await remote.session()
            assert await remote.load() == ServerLoad(running=0, queued=0, capacity=1, sessions=1)
            await s.aclose()
    finally:
        await handle.stop()
