"""The local sandbox: bubblewrap namespaces + cgroup v1 limits + rlimits, no daemon needed.

Each program runs in its own throw-away sandbox:

- namespaces: user, mount, PID, network (loopback only: the host's loopback services are unreachable), IPC,
  UTS; ``--die-with-parent``; no nested user namespaces;
- file system: ``/usr`` read-only (``/usr/local`` hidden) with the toolchains installed there (see
  ``languages.py``), the ``/bin``/``/lib*`` links, the ``/etc`` entries the dynamic loader and the JDK need
  (``ld.so.cache``, ``alternatives``, ``java-*``), a fresh ``/proc`` and ``/dev``; the root is read-only and the only writable places
  are size-capped tmpfs: ``/tmp`` (the working dir) and ``/dev/shm``. Not the host's home, ``/root``,
  ``/tmp``, the project or any secret;
- identity: uid/gid 65534 outside the user namespace too (bubblewrap is started through ``setpriv``), so
  ``RLIMIT_NPROC`` counts; all capabilities dropped, ``no_new_privs``; a clean environment;
- limits: a memory + pids + cpu cgroup per sandbox when the cgroup tree is writable, rlimits always (CPU time,
  file size, open files, address space, processes); the wall-clock limit kills the whole PID namespace.

A warm pool keeps ``pool_size`` sandboxes started (bubblewrap + the launcher, waiting for a request), so a run
costs a fork in an already-running interpreter rather than a process start. Between runs the launcher kills
every process of the sandbox, empties every writable place (``/tmp``, ``/dev/shm``, ``/dev/mqueue``) and
checks that no process and no SysV IPC object is left; a sandbox that is not clean, timed out, or served
``max_uses`` runs is destroyed instead of reused. A session's sandbox is never reused. The pool, the runs and
the sessions are the shared core's (``_core.WarmSandbox``); this module says how one sandbox starts and stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError, SandboxError
from agentrl.sandbox._cgroup import Cgroup, CgroupTree
from agentrl.sandbox._core import START_ERRORS, WarmSandbox
from agentrl.sandbox._wire import SANDBOX_ENV, Conn, launcher_source, ping
from agentrl.sandbox.base import Limits

log = logging.getLogger(__name__)

NOBODY = 65534
PIDS_OVERHEAD = 3  # bubblewrap (2 processes) and the launcher share the cgroup with the program
# Writes its own pid into each cgroup.procs given before "--", then execs the rest: the tree never runs outside.
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 97; shift; done; shift; exec "$@"'
INSTALL_HINT = "install it with `apt-get install bubblewrap` (or run scripts/install_system.sh)"


class _LocalBox:
    """One started sandbox: bubblewrap's process, the launcher's stream, the cgroup."""

    def __init__(self, proc: asyncio.subprocess.Process, cgroup: Cgroup | None) -> None:
        assert proc.stdout is not None and proc.stdin is not None
        self.proc, self.cgroup = proc, cgroup
        self.conn = Conn(proc.stdout, proc.stdin)
        self.uses = 0

    def alive(self) -> bool:
        return self.proc.returncode is None

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    async def stderr_tail(self) -> str:
        assert self.proc.stderr is not None
        try:
            data = await asyncio.wait_for(self.proc.stderr.read(4096), 0.5)
        except (TimeoutError, OSError):
            data = b""
        return data.decode("utf-8", errors="replace").strip()

    async def destroy(self) -> None:
        """SIGKILL bubblewrap (``--die-with-parent`` then takes down the PID namespace), kill what the cgroup
        still holds, remove the cgroup."""
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            log.warning("bubblewrap pid %s did not exit 5s after SIGKILL", self.proc.pid)
        if self.cgroup is not None:
            await self.cgroup.remove()


class LocalSandbox(WarmSandbox[_LocalBox]):
    """Sandbox backend on bubblewrap. ``max_concurrency`` bounds concurrent runs (others wait), ``pool_size``
    sandboxes are kept warm, at most ``max_sessions`` sessions are open (``session()`` waits up to
    ``session_wait_s`` for a slot), a session idle for ``session_idle_s`` is closed. ``use_cgroups``: None uses
    them when writable, True requires them, False never uses them. ``cpus`` is each sandbox's CPU quota; at most
    ``max_starting`` sandboxes start at once."""

    kind = "local"

    def __init__(self, *, max_concurrency: int = 8, pool_size: int | None = None, max_sessions: int = 64,
                 session_idle_s: float = 600.0, session_wait_s: float = 60.0, python: str = "/usr/bin/python3",
                 scratch_mb: int = 64, cpus: float = 1.0, use_cgroups: bool | None = None,
                 start_timeout_s: float = 10.0, grace_s: float = 2.0, max_uses: int = 200,
                 max_starting: int = 4) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxError(f"the local sandbox needs bubblewrap (`bwrap` is not on PATH): {INSTALL_HINT}")
        real = Path(python).resolve()
        if not real.is_file() or not str(real).startswith("/usr/"):
            raise ConfigError(f"the local sandbox runs a system interpreter under /usr, got {python!r} "
                              f"({real}): apt-get install python3, or pass python='/usr/bin/python3'")
        # one pool for every limit: a run's limits are set on its sandbox's cgroup and rlimits, not at its start
        super().__init__(limits=Limits(), max_concurrency=max_concurrency, pool_size=pool_size,
                         max_sessions=max_sessions, session_idle_s=session_idle_s, session_wait_s=session_wait_s,
                         start_timeout_s=start_timeout_s, grace_s=grace_s, max_uses=max_uses,
                         max_starting=max_starting)
        self.python, self.scratch_mb, self.cpus = python, scratch_mb, cpus
        self._use_cgroups = use_cgroups
        self._cgroups: CgroupTree | None = None
        self._drop: list[str] = []
        self._nproc: int | None = None
        self._argv: list[str] = []
        self._nproc_budget = 64 * (max_concurrency + max_sessions + self._pool_size) + 256

    # ------------------------------------------------------------------------------------------- set-up

    async def _setup(self) -> None:
        """Detect cgroups, the user to run as, and bubblewrap's features."""
        if self._use_cgroups is not False:
            self._cgroups = CgroupTree.detect()
            if self._cgroups is None and self._use_cgroups:
                raise SandboxError("use_cgroups=True but no cgroup v1 memory/pids/cpu tree is writable here")
            if self._cgroups is not None:
                await self._cgroups.sweep_stale()
        if os.geteuid() == 0:  # drop to nobody outside the user namespace: RLIMIT_NPROC then counts
            if not os.access("/usr/bin/setpriv", os.X_OK):
                raise SandboxError("the local sandbox drops root with setpriv: apt-get install util-linux")
            self._drop = ["/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
            # RLIMIT_NPROC counts every process of uid 65534 on the host (all sandboxes, Docker's too):
            # a backstop sized for all of them; the pids cgroup is the per-run limit.
            self._nproc = self._nproc_budget
        self._argv = [*self._bwrap_args(await asyncio.to_thread(_bwrap_help, self.bwrap or "bwrap")),
                      self.python, "-I", "-c", launcher_source()]
        log.info("local sandbox: cgroups %s, uid %s",
                 ",".join(self._cgroups.controllers) if self._cgroups else "none",
                 NOBODY if self._drop else os.geteuid())

    def _bwrap_args(self, help_text: str) -> list[str]:
        args = [self.bwrap or "bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
                "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox"]
        if "--disable-userns" in help_text:
            args.append("--disable-userns")
        args += ["--ro-bind", "/usr", "/usr"]
        hide_local = Path("/usr/local").is_dir() and not str(Path(self.python).resolve()).startswith("/usr/local/")
        if hide_local:
            args += ["--tmpfs", "/usr/local"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            p = Path("/") / name
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                args += ["--ro-bind", str(p), str(p)]
        # the loader's cache; Debian's alternatives (BLAS, java, javac); the JDK's conf (its lib/ links there)
        for etc in ("/etc/ld.so.cache", "/etc/alternatives", *sorted(map(str, Path("/etc").glob("java-*")))):
            if os.path.exists(etc):
                args += ["--ro-bind", etc, etc]
        args += ["--proc", "/proc", "--dev", "/dev", "--mqueue", "/dev/mqueue"]
        size = ["--size", str(self.scratch_mb << 20)] if "--size" in help_text else []
        if not size:
            log.warning("bubblewrap has no --size: /tmp in the sandbox is bounded only by the memory cgroup")
        # Writable: only the two sized tmpfs; the root and /dev (tmpfs made by bubblewrap) become read-only.
        args += [*size, "--tmpfs", "/dev/shm", *size, "--tmpfs", "/tmp", "--remount-ro", "/dev",
                 *(["--remount-ro", "/usr/local"] if hide_local else []), "--remount-ro", "/",
                 "--chdir", "/tmp", "--clearenv"]
        for key, value in SANDBOX_ENV.items():
            args += ["--setenv", key, value]
        return args

    async def _spawn(self, limits: Limits) -> _LocalBox:
        del limits  # set per run (_prepare): any warm sandbox serves any limits
        cgroup = self._cgroups.create() if self._cgroups is not None else None
        argv = ["/bin/sh", "-c", _JOIN, "sh", *(cgroup.procs_files if cgroup else []), "--", *self._drop,
                *self._argv]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={"PATH": "/usr/bin:/bin"})
        except OSError as exc:
            if cgroup is not None:
                await cgroup.remove()
            raise SandboxError(f"could not start bubblewrap: {exc}") from None
        box = _LocalBox(proc, cgroup)
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await ping(box.conn)
        except START_ERRORS as exc:
            why = await box.stderr_tail()
            await box.destroy()
            raise SandboxError(
                f"the local sandbox did not start ({type(exc).__name__}): {why or 'no message'}; check that "
                f"bubblewrap can make namespaces here: bwrap --unshare-all --ro-bind /usr /usr /usr/bin/true"
            ) from None
        return box

    async def _prepare(self, worker: _LocalBox, limits: Limits) -> None:
        if worker.cgroup is not None:
            worker.cgroup.set_limits(memory_mb=limits.memory_mb, pids=limits.pids + PIDS_OVERHEAD, cpus=self.cpus)

    def _launch_options(self) -> dict[str, Any]:
        return {"cgroup_memory": self._cgroups is not None and "memory" in self._cgroups.parents,
                "nproc": self._nproc}

    # ------------------------------------------------------------------------------------------- teardown

    def leftover_cgroups(self) -> list[Path]:
        return self._cgroups.ours() if self._cgroups is not None else []


def _bwrap_help(bwrap: str) -> str:
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"bubblewrap does not run ({exc}): {INSTALL_HINT}") from None
    return out.stdout + out.stderr
