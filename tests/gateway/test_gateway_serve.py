"""``agentrl gateway serve`` as a user starts it: its own SGLang server (tiny model) and the gateway, one process;
a session, one chat call with the official ``openai`` client, the session finalized into a training branch.

Every wait is bounded; at the end the CLI gets SIGINT (uvicorn shuts down, the CLI stops its SGLang server), then
both process groups are killed (SGLang runs in its own group, a child of the CLI)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from agentrl.engine.server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after the parenthesised name
                found.add(int(entry.name))
    return found


def _stop(proc: subprocess.Popen[bytes], groups: set[int]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=10)


async def test_gateway_serve_answers_the_openai_client_and_finalizes_a_training_branch(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "gateway", "serve", "--model", "tiny",
                                 "--port", str(port), "--log-dir", str(tmp_path / "logs"),
                                 "--max-total-tokens", "4096", "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    groups = {proc.pid}
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            try:
                async with asyncio.timeout(300):  # SGLang's start on the CPU, then uvicorn's
                    while True:
                        assert proc.poll() is None, f"gateway serve exited:\n{log.read_text()[-3000:]}"
                        groups |= _children(proc.pid)
                        try:
                            if (await http.get(f"{url}/healthz")).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        await asyncio.sleep(0.5)
            except TimeoutError:
                pytest.fail(f"gateway serve did not answer within 300 s:\n{log.read_text()[-3000:]}")
            groups |= _children(proc.pid)  # the SGLang server, in its own process group
            assert (await http.get(f"{url}/healthz")).json()["model"] == "tiny"

            created = (await http.post(f"{url}/sessions")).json()
            assert created["base_url"] == f"{url}/sessions/{created['id']}/v1"
            async with openai.AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0,
                                          timeout=120) as client:
                answer = await client.chat.completions.create(
                    model="tiny", max_tokens=8, messages=[{"role": "user", "content": "What is 2+3?"}])
            assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage is not None
            posted = await http.post(f"{url}/sessions/{created['id']}/reward", json={"reward": 1.0, "finished": True})
            assert posted.status_code == 200
            done = (await http.post(f"{url}/sessions/{created['id']}/finalize")).json()
    finally:
        _stop(proc, groups)

    assert done["reward"] == 1.0 and done["finished"]
    (branch,) = done["branches"]
    n, p = len(branch["token_ids"]), answer.usage.prompt_tokens
    assert len(branch["loss_mask"]) == len(branch["logprobs"]) == len(branch["weight_versions"]) == n
    assert branch["prompt_len"] == p and n == p + answer.usage.completion_tokens
    assert branch["loss_mask"] == [0] * p + [1] * (n - p)  # the sampled ids, and only they, are trained
    assert all(lp <= 0 for lp in branch["logprobs"][p:]) and any(lp < 0 for lp in branch["logprobs"][p:])
    assert branch["weight_versions"][p:] == [0] * (n - p)  # a fresh server serves version 0
    assert not any(map(_alive, groups)), "the CLI or its SGLang server outlived the shutdown"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
