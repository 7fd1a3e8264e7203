"""Tensors in named shared memory, and their handles as SGLang's ``/update_weights_from_tensor`` reads them
(``weight_sync: tensor``: the trainer and the SGLang servers on one host, no weight byte crosses a socket).

    shared_bytes(n)          a uint8 tensor of ``n`` bytes in a ``/dev/shm`` file (torch's "file_system" sharing)
    serialize(named)         ``[(name, tensor), ...]`` as the base64 pickle SGLang's ``MultiprocessingSerializer``
                             reads: for each storage, its shm file's name and torch_shm_manager's socket, no data

Why our own pickler: torch pickles CPU storages by file descriptor unless the process-wide sharing strategy is
``file_system``, and a descriptor can only pass to a process that shares the sender's multiprocessing authkey (a
child), not to a server started apart. Setting that strategy would change it for everything in the trainer's
process (DataLoader workers included), so this pickler uses torch's own ``file_system`` reduction for the storages
it writes and nothing else. The receiver rebuilds them with ``torch.multiprocessing.reductions
.rebuild_storage_filename``, which SGLang's SafeUnpickler allows. Both ``UntypedStorage._new_using_filename_cpu``
and ``_share_filename_cpu_`` are private torch API (torch 2.x; the multiprocessing module uses them the same way);
tests/engine/test_weight_sync_sglang.py would catch a torch release that changed them.

Lifetime: a shm file is unlinked when its reference count (in the file) reaches zero. Each serialization takes one
reference per storage (``_shared_incref``) that the receiver gives back once it has mapped the file, so the file
outlives a sender that drops its tensor first; a payload that is never deserialized (a server that died before
reading it), or a receiver that dies while it maps the memory (the count lives in the file, not in the kernel),
leaves its file in /dev/shm until torch_shm_manager cleans up after the trainer. One payload is therefore for one
receiver: two receivers of one payload would give back two references for one taken.
"""

from __future__ import annotations

import base64
import io
import os
import threading
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from torch import Tensor
from torch.multiprocessing.reductions import rebuild_storage_filename

from agentrl.weight_sync import WeightSyncError


def shared_bytes(nbytes: int, shm_dir: str = "/dev/shm") -> Tensor:
    """A uint8 tensor of ``nbytes`` bytes backed by a named shm file (uninitialised). WeightSyncError if ``shm_dir``
    has not that much room: the file would be made anyway (sparse), and the first write past the room a SIGBUS."""
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        raise WeightSyncError(f"shared memory is not available here ({shm_dir}: {exc}); weight_sync: tensor needs "
                              "it: use weight_sync: distributed") from exc
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise WeightSyncError(f"{shm_dir} has {free >> 20} MiB free, a weight snapshot needs {nbytes >> 20} MiB more "
                              "(a version is held while the previous one is still being read): give the container "
                              "more (docker --shm-size) or use weight_sync: distributed")
    _start_manager_quietly()
    storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


_manager_lock = threading.Lock()
_manager_started = False  # per process, as torch's own manager is


def _start_manager_quietly() -> None:
    """Start torch's shm manager with its stdout and stderr on /dev/null. torch starts ``torch_shm_manager`` (the
    daemon that unlinks a file once no process maps it) at a process's first named allocation, and it inherits
    that process's stdout and stderr; it lives as long as any process that mapped our memory (the SGLang servers),
    so whoever waits for the end of our output on a pipe (``subprocess.run(capture_output=True)``) would wait for
    the servers to exit. While it starts, the other threads' prints go to /dev/null."""
    global _manager_started
    with _manager_lock:
        if _manager_started:
            return
        saved = [os.dup(1), os.dup(2)]
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            torch.UntypedStorage._new_using_filename_cpu(1)  # starts the manager; freed at once
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (*saved, devnull):
                os.close(fd)
        _manager_started = True


def _reduce_by_name(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    if storage.device.type != "cpu":
        raise ValueError(f"only CPU tensors are shared by name, got one on {storage.device}")
    manager, handle, size = storage._share_filename_cpu_()  # a no-op for shared_bytes' storages
    storage._shared_incref()  # given back by the receiver's rebuild_storage_filename
    return rebuild_storage_filename, (type(storage), manager, handle, size)


class _ByNamePickler(ForkingPickler):
    def __init__(self, buf: io.BytesIO) -> None:
        super().__init__(buf)
        self.dispatch_table[torch.UntypedStorage] = _reduce_by_name  # this pickler's table: a copy


def serialize(named: Sequence[tuple[str, Tensor]]) -> str:
    """``named`` as one receiver's base64 payload for ``/update_weights_from_tensor`` (handles only)."""
    buf = io.BytesIO()
    _ByNamePickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")
