"""A math-checker worker process: ``python -m agentrl.rewards._verifier_worker --memory-mb N``.

Protocol (JSON lines): it writes ``{"ready": true}`` once math-verify is imported, then for each request line
``{"answer": str, "reference": str, "timeout_s": float, "max_chars": int}`` it writes ``{"verdict": str}``.
The check runs in this process's main thread under a CPU-time deadline (``ITIMER_PROF``); the parent kills
the process if even that does not bring it back (code stuck in C). File descriptor 1 is kept for the
protocol: anything the libraries print goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from typing import TextIO


def _serve(proto_in: TextIO, proto_out: TextIO) -> None:
    from agentrl.rewards import _equivalence as eq

    eq.warm_up()
    proto_out.write(json.dumps({"ready": True}) + "\n")
    proto_out.flush()
    for line in proto_in:
        request = json.loads(line)
        try:
            with eq.soft_deadline(float(request["timeout_s"]), cpu=True):
                verdict = eq.check(
                    request["answer"], request["reference"], max_chars=int(request["max_chars"])
                )
        except eq.CheckTimeout:
            verdict = eq.Verdict.TIMEOUT
        except (RecursionError, MemoryError):
            verdict = eq.Verdict.MALFORMED
        except Exception:  # noqa: BLE001 -- a checker bug on this input: the answer is not scored as correct
            verdict = eq.Verdict.CHECKER_ERROR
        proto_out.write(json.dumps({"verdict": verdict.value}) + "\n")
        proto_out.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory-mb", type=int, default=0)
    args = parser.parse_args()
    if args.memory_mb > 0:  # a huge expression fails with MemoryError instead of swapping the machine
        limit = args.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(sys.stdin, proto_out)


if __name__ == "__main__":
    main()
