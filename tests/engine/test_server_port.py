"""A server's port taken by another process while SGLang starts (SGLang binds it only after loading the model, ~30 s
after agentrl chose it; any socket bound to port 0 meanwhile may get it). The server process is a fake here (a
small HTTP server that binds its port as uvicorn does, and exits 3 with uvicorn's message when it cannot): the logic
around it. A real SGLang server whose port is taken is in test_pool_sglang.py."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import pytest
from port_support import Squatter

from agentrl.engine.server import PORT_MOVES, SGLangServer, SGLangServerConfig, group_listens_on
from agentrl.errors import EngineError

FAKE_SGLANG = """import http.server, sys, time
port, delay = int(sys.argv[1]), float(sys.argv[2])
time.sleep(delay)  # SGLang loads its model before it binds
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)  # SO_REUSEADDR, as uvicorn binds
except OSError as exc:  # uvicorn logs asyncio's message, then exits with STARTUP_FAILURE
    print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
          f"{exc.strerror.lower()}", flush=True)
    sys.exit(3)
server.serve_forever()
"""


class FakeServer(SGLangServer):
    exit_code: int | None = None  # set: exit with it instead of serving

    def command(self) -> list[str]:
        if self.exit_code is not None:
            return [sys.executable, "-c", f"import sys; print('boom', flush=True); sys.exit({self.exit_code})"]
        return [sys.executable, "-c", FAKE_SGLANG, str(self.port), "0.5"]


def config(port: int = 0) -> SGLangServerConfig:
    # python set: prepare() builds no CPU kernel (the fake needs none)
    return SGLangServerConfig(model_path="/nonexistent/model", port=port, python=sys.executable,
                              startup_timeout_s=60)


def test_a_port_taken_while_starting_is_given_up_for_another(squatter: Squatter, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    spawns: list[int] = []

    def on_spawn(server: SGLangServer) -> None:
        spawns.append(server.port)
        if len(spawns) == 1:
            squatter.take(server.port)  # after the launch, before the fake binds: as in a real start

    server = FakeServer(config(), log_path=tmp_path / "s.log", on_spawn=on_spawn)
    with caplog.at_level(logging.WARNING, logger="agentrl.engine.server"), server:
        # the squatter answered /health 200 meanwhile: not taken for this server
        assert server.port != squatter.ports[0] and spawns == [squatter.ports[0], server.port]
        assert group_listens_on(server.pid, server.port) is True
        assert group_listens_on(server.pid, squatter.ports[0]) is False
        assert f"port {squatter.ports[0]} was taken by another process" in caplog.text
    assert "address already in use" in (tmp_path / "s.log").read_text()  # the first launch's, kept in the log


def test_a_port_taken_before_the_launch_is_not_tried(squatter: Squatter, tmp_path: Path) -> None:
    spawns: list[int] = []
    server = FakeServer(config(), log_path=tmp_path / "s.log", on_spawn=lambda s: spawns.append(s.port))
    squatter.take(server.port)
    with server:
        assert spawns == [server.port] and server.port != squatter.ports[0]


def test_a_configured_port_that_is_taken_is_an_error_naming_it(squatter: Squatter, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = FakeServer(config(port), log_path=tmp_path / "s.log", on_spawn=lambda s: squatter.take(s.port))
    with pytest.raises(EngineError, match=rf"could not listen on 127\.0\.0\.1:{port}: .*engine\.port: choose"):
        server.start()
    assert server.port == port and not server.alive()


def test_the_moves_are_bounded(squatter: Squatter, tmp_path: Path) -> None:
    server = FakeServer(config(), log_path=tmp_path / "s.log", on_spawn=lambda s: squatter.take(s.port))
    with pytest.raises(EngineError, match=f"{PORT_MOVES} other ports tried"):
        server.start()
    assert len(squatter.ports) == PORT_MOVES + 1 and not server.alive()


def test_a_restart_keeps_its_port(squatter: Squatter, tmp_path: Path) -> None:
    server = FakeServer(config(), log_path=tmp_path / "s.log")
    with server:
        assert not server.gc_frozen  # the stand-in answers POST /freeze_gc with 501: it serves on regardless
        port = server.port
        server.stop()
        squatter.take(port)
        with pytest.raises(EngineError, match="a restarted server keeps its port"):
            server.restart()  # its clients hold the URL: moving would strand them
        assert server.port == port


def test_another_exit_while_starting_is_reported_with_the_log(tmp_path: Path) -> None:
    server = FakeServer(config(), log_path=tmp_path / "s.log")
    server.exit_code = 3  # uvicorn's code, but the log says nothing of the port: not taken for a taken port
    with pytest.raises(EngineError, match=r"exited with code 3 while starting; see .*\n.*boom"):
        server.start()


def test_a_squatter_that_is_no_http_server_is_waited_out(squatter: Squatter, tmp_path: Path) -> None:
    server = FakeServer(config(), log_path=tmp_path / "s.log",
                        on_spawn=lambda s: None if squatter.ports else squatter.take_raw(s.port))
    with server:  # its garbage answers to /health are no readiness and no crash of the wait
        assert server.port != squatter.ports[0]


def test_without_a_log_an_exit_3_moves_only_when_the_port_is_held(squatter: Squatter) -> None:
    server = FakeServer(config(), on_spawn=lambda s: None if squatter.ports else squatter.take(s.port))
    with server:
        assert server.port != squatter.ports[0]
    other = FakeServer(config())
    other.exit_code = 3  # uvicorn's code, its port free: some other start failure, reported as such
    with pytest.raises(EngineError, match="exited with code 3 while starting"):
        other.start()


def test_a_server_stopped_meanwhile_is_not_launched_again(tmp_path: Path) -> None:
    """A stop() from another thread (a cancelled start, a sibling server's failure) between the failed launch and
    the move: the move launches nothing, so no process group outlives the run's clean-up."""
    server = FakeServer(config(), log_path=tmp_path / "s.log")
    server.exit_code = 3
    server.start_background()
    proc = server._proc
    assert proc is not None
    proc.wait(timeout=30)
    server.stop()  # the other thread's stop
    assert server._move_port(proc) is None and server._proc is None
