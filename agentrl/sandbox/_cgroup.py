"""cgroup v1 limits for the local sandbox: memory, pids and cpu, one cgroup per sandboxed process tree.

Each cgroup is made *below* the cgroup this process is in (so whatever limits our own process has still bind
the sandbox), named ``agentrl-<our pid>-<tree id>-<n>``. A tree is put in its cgroups before bubblewrap starts (the
spawning shell writes its own pid into ``cgroup.procs`` and then execs), so no process of it ever runs outside.
Removal kills what is left and retries ``rmdir`` until the kernel has let go.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu")
ROOT = Path("/sys/fs/cgroup")
PREFIX = "agentrl-"
CPU_PERIOD_US = 100_000


def _own_path(controller: str) -> str | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return path
    return None


class Cgroup:
    """One process tree's cgroups (one directory per controller)."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def set_limits(self, *, memory_mb: int, pids: int, cpus: float) -> None:
        """Raises OSError if the kernel refuses (e.g. memory below what the tree already uses)."""
        if "memory" in self.dirs:
            mem = str(memory_mb << 20)
            d = self.dirs["memory"]
            # memsw must stay >= memory: order the writes by whether the limit goes up or down.
            files = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            current = int((d / files[0]).read_text())
            for name in files if memory_mb << 20 <= current else reversed(files):
                try:
                    (d / name).write_text(mem)
                except FileNotFoundError:  # no swap accounting: nothing to limit
                    pass
        if "pids" in self.dirs:
            (self.dirs["pids"] / "pids.max").write_text(str(pids))
        if "cpu" in self.dirs:
            (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(int(cpus * CPU_PERIOD_US)))

    def oom_kills(self) -> int:
        d = self.dirs.get("memory")
        if d is None:
            return 0
        try:
            for line in (d / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.procs_files:
            try:
                out.update(int(p) for p in Path(f).read_text().split())
            except (OSError, ValueError):
                pass
        return out

    async def remove(self, timeout_s: float = 5.0) -> bool:
        """Kill every process left, then remove the directories; False if some remain after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        remaining = dict(self.dirs)
        while remaining:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for name, d in list(remaining.items()):
                try:
                    d.rmdir()
                    del remaining[name]
                except FileNotFoundError:
                    del remaining[name]
                except OSError:
                    pass  # busy: processes still exiting
            if remaining:
                if loop.time() > end:
                    log.warning("cgroups %s still busy after %.0fs", sorted(map(str, remaining.values())),
                                timeout_s)
                    return False
                await asyncio.sleep(0.01)
        return True


class CgroupTree:
    """Where our cgroups go; ``detect()`` returns None when no controller is writable here."""

    def __init__(self, parents: dict[str, Path]) -> None:
        self.parents = parents
        self._ids = itertools.count()
        self._tag = f"{PREFIX}{os.getpid()}-{os.urandom(3).hex()}-"  # this tree's cgroups: <tag><n>

    @classmethod
    def detect(cls) -> CgroupTree | None:
        parents: dict[str, Path] = {}
        for controller in CONTROLLERS:
            own = _own_path(controller)
            base = ROOT / controller
            if own is None or not (base / "cgroup.procs").exists():
                continue
            parent = base / own.lstrip("/")
            if os.access(parent, os.W_OK):
                parents[controller] = parent
        return cls(parents) if parents else None

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(self.parents)

    def create(self) -> Cgroup:
        name = f"{self._tag}{next(self._ids)}"
        dirs: dict[str, Path] = {}
        try:
            for controller, parent in self.parents.items():
                d = parent / name
                d.mkdir()
                dirs[controller] = d
        except OSError:
            for d in dirs.values():
                d.rmdir()
            raise
        return Cgroup(dirs)

    def ours(self) -> list[Path]:
        """This tree's cgroups that still exist (for leftover checks)."""
        return [d for p in self.parents.values() for d in p.glob(self._tag + "*")]

    async def sweep_stale(self) -> int:
        """Remove cgroups left by agentrl processes that are gone (a crash); returns how many were removed."""
        removed = 0
        for controller, parent in self.parents.items():
            for d in parent.glob(PREFIX + "*"):
                try:
                    owner = int(d.name[len(PREFIX):].split("-")[0])
                except ValueError:
                    continue
                if owner != os.getpid() and not Path(f"/proc/{owner}").exists():
                    removed += await Cgroup({controller: d}).remove(timeout_s=1.0)
        return removed
