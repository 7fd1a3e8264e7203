"""Issue 3's hostile programs written in C++ and JavaScript (nodejs), against the local and Docker backends: fork
bomb, memory, network, file escapes, leftovers; then nothing is left on the host. As in test_adversarial.py, each bomb comes
after a benign probe, in the same test, proving the limit that contains it holds. The compile step's own limits
are checked too (a compiler gets more memory than the program, and the program does not keep it)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
from language_programs import language_param
from sandbox_support import ISOLATED, HostCanary, make_backend, own_descendants, processes_with

from agentrl.sandbox.base import Limits, RequestStatus, RunRequest, RunResult, RunStatus, Sandbox

MARK = f"{os.getpid() % 1000}.{int.from_bytes(os.urandom(2), 'big')}"  # unique sleep durations mark our processes
SMALL = Limits(time_s=5.0, memory_mb=128, pids=32, file_size_mb=4, output_bytes=4096, compile_time_s=60)
BEFORE: dict[int, set[int]] = {}  # our descendants before each sandbox started
pytestmark = pytest.mark.parametrize("lang", [language_param("cpp"), language_param("nodejs")])


@pytest.fixture(scope="module", params=ISOLATED)
async def sb(request: pytest.FixtureRequest) -> AsyncIterator[Sandbox]:
    before = {p.pid for p in own_descendants()}
    opts: dict[str, object] = {"limits": SMALL} if request.param == "docker" else {}  # its warm pool's limits
    box, _ = await make_backend(request.param, max_concurrency=4, pool_size=2, **opts)
    BEFORE[id(box)] = before
    probe = await box.run(RunRequest("int main() {}", "cpp", limits=SMALL))
    if probe.is_sandbox_error and "toolchain" in probe.message:  # cpp and nodejs are required, never skipped
        await box.aclose()
        pytest.fail(f"{request.param}: {probe.message}")
    try:
        yield box
    finally:
        await box.aclose()


async def run(sb: Sandbox, lang: str, code: str, limits: Limits = SMALL) -> RunResult:
    r = await sb.run(RunRequest(code=code, language=lang, limits=limits))
    assert not r.is_sandbox_error, r
    assert r.compile is None or r.compile.ok, r.compile
    return r


CPP = "#include <bits/stdc++.h>\n#include <unistd.h>\n#include <sys/socket.h>\n#include <netinet/in.h>\n" \
      "#include <arpa/inet.h>\n#include <net/if.h>\n#include <signal.h>\n#include <fcntl.h>\nusing namespace std;\n"


async def assert_healthy(sb: Sandbox, lang: str) -> None:
    code = {"cpp": CPP + 'int main() { puts("ok"); }', "nodejs": "console.log('ok')"}[lang]
    r = await run(sb, lang, code)
    assert (r.status, r.stdout) == (RequestStatus.SUCCESS, "ok\n"), r


async def test_fork_bomb_is_contained(sb: Sandbox, lang: str) -> None:
    probe = {
        "cpp": CPP + "int main() { vector<pid_t> kids; for (int n = 0; n < 60; n++) { pid_t p = fork();"
                     " if (p == 0) { sleep(5); _exit(0); } if (p < 0) break; kids.push_back(p); }"
                     ' printf(kids.size() < 60 ? "refused at %zu\\n" : "NOT LIMITED %zu\\n", kids.size());'
                     " for (pid_t k : kids) kill(k, SIGKILL); }",
        "nodejs": "const cp = require('child_process'); const kids = []; let refused = -1;\n"
                  "for (let i = 0; i < 60; i++) { try { const k = cp.spawn('sleep', ['5']);"
                  " k.on('error', () => { if (refused < 0) refused = i; }); kids.push(k); }"
                  " catch (e) { if (refused < 0) refused = i; break; } }\n"
                  "setTimeout(() => { console.log(refused >= 0 ? 'refused at ' + refused : 'NOT LIMITED');"
                  " kids.forEach(k => k.kill('SIGKILL')); process.exit(0); }, 1000);",
    }[lang]
    r = await run(sb, lang, probe, Limits(time_s=10.0, pids=16, compile_time_s=60))
    assert r.stdout.startswith("refused at") and int(r.stdout.split()[-1]) <= 16, r
    bomb = {"cpp": CPP + "int main() { for (;;) fork(); }",
            "nodejs": "const cp = require('child_process');\n"
                      "for (;;) { try { cp.spawn(process.execPath, ['-e', 'for(;;){}']); } catch (e) {} }"}[lang]
    r = await run(sb, lang, bomb, Limits(time_s=2.0, pids=32, compile_time_s=60))
    assert r.status is RequestStatus.FAILED, r
    await assert_healthy(sb, lang)


async def test_memory_is_the_programs_limit_not_the_compilers(sb: Sandbox, lang: str) -> None:
    def alloc(mb: int) -> str:
        return {"cpp": CPP + f"int main() {{ size_t n = (size_t){mb} << 20; volatile char* p = (char*)malloc(n);"
                             " if (!p) return 9; for (size_t i = 0; i < n; i += 4096) p[i] = 1;"
                             " puts(\"fits\"); }",
                "nodejs": f"const b = Buffer.alloc({mb} << 20, 1); console.log('fits');"}[lang]

    probe = await run(sb, lang, alloc(48))
    assert probe.stdout == "fits\n", probe  # under the limit: allowed
    over = await run(sb, lang, alloc(400))  # over the program's 128 MB, under the compiler's 1024 MB
    assert over.status is RequestStatus.FAILED and "fits" not in over.stdout, over
    bomb = {"cpp": CPP + "int main() { vector<volatile char*> v; for (;;) { volatile char* p = (char*)malloc(16 << 20);"
                         " if (p) { for (int i = 0; i < 16 << 20; i += 4096) p[i] = 1; v.push_back(p); } } }",
            "nodejs": "const a = []; for (;;) a.push(Buffer.alloc(16 << 20, 1));"}[lang]
    r = await run(sb, lang, bomb)
    assert r.status is RequestStatus.FAILED and r.run_status is not RunStatus.FINISHED, r
    await assert_healthy(sb, lang)


async def test_the_compile_step_has_its_own_memory_limit(sb: Sandbox, lang: str) -> None:
    """g++ on <bits/stdc++.h> needs ~200 MB: under a 64 MB compile limit it is killed (the program's failure),
    with the default 1024 MB it compiles, and the program then runs under its own 64 MB."""
    if lang != "cpp":
        pytest.skip("nodejs has no compile step")
    code = CPP + 'int main() { map<string, vector<int>> m; m["a"].push_back(1); printf("%zu\\n", m.size()); }'
    small = Limits(memory_mb=64, pids=32, compile_memory_mb=64, compile_time_s=60)
    r = await sb.run(RunRequest(code, "cpp", limits=small))
    assert r.status is RequestStatus.FAILED and r.compile is not None and not r.compile.ok, r
    assert r.run_status is None and "did not compile" in r.message, r
    r = await sb.run(RunRequest(code, "cpp", limits=Limits(memory_mb=64, pids=32, compile_time_s=60)))
    assert (r.status, r.stdout, r.compile and r.compile.ok) == (RequestStatus.SUCCESS, "1\n", True), r
    await assert_healthy(sb, lang)


async def test_no_network_not_even_host_loopback(sb: Sandbox, lang: str, host_canary: HostCanary) -> None:
    code = {
        "cpp": CPP + "int main() { int s = socket(AF_INET, SOCK_STREAM, 0); sockaddr_in a{}; a.sin_family = AF_INET;"
                     f" a.sin_port = htons({host_canary.port}); inet_pton(AF_INET, \"127.0.0.1\", &a.sin_addr);"
                     ' puts(connect(s, (sockaddr*)&a, sizeof a) == 0 ? "CONNECTED" : "refused");'
                     " struct if_nameindex* n = if_nameindex(); for (auto* i = n; i && i->if_name; i++) puts(i->if_name); }",
        "nodejs": "const net = require('net');\n"
                  f"const s = net.connect({host_canary.port}, '127.0.0.1');\n"
                  "s.on('connect', () => { console.log('CONNECTED'); done(); });\n"
                  "s.on('error', () => { console.log('refused'); done(); });\n"
                  "function done() { for (const n of Object.keys(require('os').networkInterfaces())) console.log(n);"
                  " process.exit(0); }",
    }[lang]
    r = await run(sb, lang, code)
    assert r.stdout.splitlines() == ["refused", "lo"], r  # its own loopback, no other device
    with pytest.raises(BlockingIOError):
        host_canary.listener.accept()  # nothing reached the host's service


async def test_host_files_are_invisible_and_the_root_read_only(sb: Sandbox, lang: str, host_canary: HostCanary) -> None:
    reads = [host_canary.path, "/etc/shadow", "/root/.bashrc", "/work", "/proc/1/environ"]
    writes = ["/x", "/usr/x", "/etc/x", "/home/x", "/root/x"]
    code = {
        "cpp": CPP + "int main() { for (const char* p : {" + ", ".join(f'"{p}"' for p in reads) + "}) {"
                     " int fd = open(p, O_RDONLY); char buf[256] = {0}; int n = fd >= 0 ? read(fd, buf, 255) : -1;"
                     f' printf("%s %s\\n", p, n > 0 && strstr(buf, "{host_canary.secret}") ? "SECRET" : '
                     '(fd >= 0 ? "open" : "denied")); }'
                     " for (const char* p : {" + ", ".join(f'"{p}"' for p in writes) + "}) {"
                     ' int fd = open(p, O_WRONLY | O_CREAT, 0644); printf("%s %s\\n", p, fd >= 0 ? "WROTE" : "denied"); }'
                     ' const char* e = getenv("AGENTRL_TEST_CANARY"); printf("env %s\\n", e ? e : "none"); }',
        "nodejs": "const fs = require('fs');\n"
                  f"for (const p of {reads!r}) {{ let v; try {{ const d = fs.readFileSync(p, 'utf8');"
                  f" v = d.includes('{host_canary.secret}') ? 'SECRET' : 'open'; }} catch (e) {{ v = 'denied'; }}"
                  " console.log(p + ' ' + v); }\n"
                  f"for (const p of {writes!r}) {{ let v; try {{ fs.writeFileSync(p, 'x'); v = 'WROTE'; }}"
                  " catch (e) { v = 'denied'; } console.log(p + ' ' + v); }\n"
                  "console.log('env ' + (process.env.AGENTRL_TEST_CANARY || 'none'));",
    }[lang]
    r = await run(sb, lang, code)
    lines = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines())
    assert host_canary.secret not in r.stdout and lines["env"] == "none", r
    assert all(lines[p] == "denied" for p in (host_canary.path, "/etc/shadow", "/root/.bashrc")), r
    assert all(lines[p] == "denied" for p in writes), r


async def test_orphans_die_with_the_run(sb: Sandbox, lang: str) -> None:
    code = {
        "cpp": CPP + 'int main() { if (fork() == 0) { setsid(); if (fork() == 0) { execlp("sleep", "sleep", "'
                     + MARK + '1", (char*)0); } _exit(0); } usleep(200000); puts("spawned"); }',
        "nodejs": f"const k = require('child_process').spawn('sleep', ['{MARK}2'], {{detached: true, stdio: 'ignore'}});\n"
                  "k.unref(); console.log('spawned');",
    }[lang]
    r = await run(sb, lang, code)
    assert r.stdout == "spawned\n", r
    for _ in range(100):
        if not processes_with(MARK):
            break
        await asyncio.sleep(0.05)
    assert processes_with(MARK) == [], "orphaned sandbox processes survived their run"


async def test_zz_nothing_left_on_the_host(sb: Sandbox, lang: str) -> None:
    await assert_healthy(sb, lang)
    if lang != "nodejs":
        return  # the last parametrization closes the sandbox
    await sb.aclose()
    for _ in range(100):
        extra = [p for p in own_descendants() if p.pid not in BEFORE[id(sb)]]
        if not extra:
            break
        await asyncio.sleep(0.05)
    assert extra == [], "processes of the closed sandbox are still alive"
    assert processes_with(MARK) == []
    if hasattr(sb, "leftover_cgroups"):
        assert sb.leftover_cgroups() == []
    if hasattr(sb, "owner"):
        import docker

        client = docker.from_env()
        try:
            assert client.api.containers(all=True, quiet=True, filters={"label": f"agentrl.sandbox={sb.owner}"}) == []
        finally:
            client.close()
