"""Property-based fuzzing of the REST API from its own OpenAPI schema (schemathesis): no input, valid or not,
gets a 5xx. Against a real uvicorn server and Redis; the service queues only (no SGLang needed), so valid
submissions are stored and never run. Bounded: a few examples per operation, a fixed seed, a time cap."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from agentrl.api import ApiSettings

TOKEN = "fuzz-token"


def schemathesis_cli() -> str:
    exe = Path(sys.executable).with_name("schemathesis")
    if exe.exists():
        return str(exe)
    found = shutil.which("schemathesis")
    if found is None:
        pytest.skip("schemathesis is not installed (pip install schemathesis)")
    return found


@pytest.mark.parametrize("authorised", [True, False], ids=["with-token", "without-token"])
async def test_fuzzing_from_the_openapi_schema_finds_no_server_error(settings: ApiSettings, start_api,
                                                                     tmp_path: Path, authorised: bool) -> None:
    server = await start_api(settings.model_copy(update={"token": TOKEN, "max_tasks": 0}))
    args = [schemathesis_cli(), "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
            "--max-examples", "12", "--seed", "1234",
            "--phases", "examples,coverage,fuzzing" if authorised else "fuzzing",  # without: every answer is 401
            "--generation-database", "none", "--workers", "1", "--no-color", "--request-timeout", "20",
            "--report", "junit", "--report-dir", str(tmp_path / "report")]
    if authorised:
        args += ["-H", f"Authorization: Bearer {TOKEN}"]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, cwd=tmp_path)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-6000:]
    async with httpx.AsyncClient() as http:
        schema = (await http.get(f"{server.url}/openapi.json")).json()
    operations = sum(len(methods) for methods in schema["paths"].values())
    assert operations >= 11 and f"Tested: {operations}" in text, text[-3000:]  # every operation was exercised
