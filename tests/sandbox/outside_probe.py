"""Run inside a private network namespace (``unshare -n``) by test_adversarial: can a sandbox reach a host outside it?

The "outside" is ours: ``OUTSIDE`` is added to this namespace's loopback device and a TCP listener waits there.
The namespace has no other device and no route, so nothing can leave the machine, whatever the sandbox does.
The same probe program runs twice: first as a plain process in this namespace (the positive control: it must
connect, and the listener must see it), then in a sandbox of the backend named on the command line (it must not
connect, and the listener must see nothing). The probe only tries to connect when its own view of the network is
loopback alone, so a sandbox given a real network device (a Docker container on a bridge, or on the host's
network) is reported as such instead of sending anything. Prints one JSON line: what the control and the
sandbox printed, and what the listener accepted after each.

Usage: unshare -n python outside_probe.py {local,docker}
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

from sandbox_support import make_backend

from agentrl.sandbox.base import Limits, RunRequest

OUTSIDE = "10.200.0.1"

PROBE = """
import socket
names = sorted(n for _, n in socket.if_nameindex())
print(names)
if set(names) <= {{'lo'}}:  # nothing but loopback: no connection attempt can leave the machine
    try:
        socket.create_connection(({host!r}, {port}), timeout=2).close()
        print('CONNECTED')
    except OSError as e:
        print(type(e).__name__)
else:
    print('NOT TRIED: a network device other than lo')
"""


def accepted(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


async def main(backend: str) -> dict[str, object]:
    for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{OUTSIDE}/32", "dev", "lo"]):
        subprocess.run(cmd, check=True, capture_output=True)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((OUTSIDE, 0))
    listener.listen(8)
    listener.setblocking(False)
    code = PROBE.format(host=OUTSIDE, port=listener.getsockname()[1])

    control = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    result: dict[str, object] = {"control": control.stdout + control.stderr, "control_accepted": accepted(listener)}

    sandbox, _ = await make_backend(backend, max_concurrency=1, pool_size=1)
    try:
        r = await sandbox.run(RunRequest(code=code, limits=Limits(time_s=10.0)))
    finally:
        await sandbox.aclose()  # type: ignore[attr-defined]
    result.update(sandbox=r.stdout + r.stderr, sandbox_status=r.status.value, sandbox_accepted=accepted(listener))
    return result


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
