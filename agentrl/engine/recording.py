"""A debugging proxy that records every ``generate`` call (ids sent, ids/logprobs returned) to a JSONL file.

Turned on with ``engine.record_requests: true``; it lets a test (or a user chasing a tokenisation bug) check
that trajectories hold exactly the tokens the engine saw and produced.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.engine.base import GenerateResult, SamplingParams


class RecordingEngine:
    """Wraps an engine; forwards everything, appends one JSON line per ``generate``."""

    def __init__(self, inner: Any, path: Path) -> None:
        self.inner = inner
        self.path = path
        self._file = open(path, "a")

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       sticky_key: str | None = None) -> GenerateResult:
        out: GenerateResult = await self.inner.generate(input_ids, sampling, sticky_key=sticky_key)
        self._file.write(json.dumps({"key": sticky_key, "input_ids": list(input_ids), "output_ids": out.output_ids,
                                     "logprobs": out.logprobs, "versions": out.weight_versions,
                                     "finish": out.finish.value}) + "\n")
        self._file.flush()
        return out

    async def prefill(self, input_ids: Sequence[int], *, sticky_key: str | None = None) -> None:
        # explicit, not through __getattr__: isinstance(…, PrefillEngine) looks attributes up statically (3.12+)
        await self.inner.prefill(input_ids, sticky_key=sticky_key)

    def __getattr__(self, name: str) -> Any:  # update_weights, pause, resume, weight_version, …
        return getattr(self.inner, name)

    async def aclose(self) -> None:
        self._file.close()
