"""Sessions: the token paths (branches) an agent's requests built, the continuity rule, and the session store.

Every generation commits ``seq = prompt ids + sampled ids`` (exactly what the engine was given and returned):

- into the branch with the longest common token prefix, if that branch is a prefix of ``seq`` (the branch grows:
  the new prompt tokens with loss mask 0, the sampled ones with mask 1 and the engine's logprobs and versions);
- or, if ``seq`` lies inside that branch and the branch has mask 1 on the sampled positions, nothing is new;
- else into a new branch **forked at the first differing token**: ``parent`` and ``fork_at`` (the length of the
  common prefix) say which tokens it shares; its data on ``[:fork_at]`` is the parent's (loss weight for shared
  tokens belongs to the parent), except that its own sampled tokens always carry this generation's data.

Invariant, checked on every commit (``ContinuityError`` otherwise): ``branch.token_ids[:len(seq)] == seq``, the
sampled positions have mask 1 and exactly the engine's logprobs and versions.

Bridging: after a commit the session remembers the canonical key (:func:`agentrl.gateway.messages.prefix_keys`)
of the request's messages plus the assistant message it answered → (branch, token end). A later request whose
messages are such a key's messages followed by user/tool messages starts from those tokens verbatim (the model's
own sampled ids, never re-tokenised); the gateway adds the template's delta for the tail. Branches only ever grow,
so a prompt taken from a branch stays valid while its generation runs.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.gateway.base import ContinuityError, SessionClosed, SessionLimits, SessionNotFound


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (slice comparisons: C speed, O(n log n))."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True)
class TurnRecord:
    """One generation committed to a branch: its sampled tokens are ``token_ids[start:end]``."""

    start: int
    end: int
    finish_reason: str
    ill_formed: bool = False
    tool_calls: int = 0
    bridged: bool = False  # the prompt kept stored tokens and added a chat-template delta
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()  # (name, arguments) of the tool calls read from it


@dataclass(slots=True)
class Branch:
    """One token path. ``weight_versions`` is -1 and ``logprobs`` 0.0 where ``loss_mask`` is 0."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    parent: int | None = None
    fork_at: int = 0  # token_ids[:fork_at] == parent's: their loss weight belongs to the parent
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        """Tokens before the first sampled one."""
        return next((i for i, m in enumerate(self.loss_mask) if m), len(self.loss_mask))

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "parent": self.parent, "fork_at": self.fork_at, "prompt_len": self.prompt_len,
                "token_ids": self.token_ids, "loss_mask": self.loss_mask, "logprobs": self.logprobs,
                "weight_versions": self.weight_versions, "turns": [asdict(t) for t in self.turns],
                "finish_reason": self.turns[-1].finish_reason if self.turns else None}


@dataclass(frozen=True, slots=True)
class Sampled:
    """What the engine returned for one prompt (possibly over several resumed requests)."""

    ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]


class Session:
    """One agent run's requests: its branches, bridge points, reward and in-flight generations."""

    def __init__(self, sid: str, api_key: str, metadata: dict[str, Any] | None = None, *, replay_size: int = 64,
                 limits: SessionLimits | None = None):
        self.id, self.api_key = sid, api_key
        self.metadata = dict(metadata or {})
        self.limits = limits or SessionLimits()
        self.generations = 0  # generations started (the turn budget counts these)
        self.exhausted: str | None = None  # "max_turns" or "length": a request was refused for the budget
        self.last_branch: int | None = None  # the branch the latest commit went to
        self.engine_errors: list[str] = []  # engine failures answered (HTTP 503) in this session
        self.branches: list[Branch] = []
        self.reward: float | None = None
        self.finished = False
        self.metrics: dict[str, float] = {}
        self.closed = False
        self.requests = 0
        self.replayed = 0
        self._bridges: dict[str, tuple[int, int]] = {}  # canonical key -> (branch, token end)
        self.replies: OrderedDict[str, asyncio.Task[Any]] = OrderedDict()  # body key -> its generation
        self.replay_size = replay_size
        self.inflight: set[asyncio.Task[Any]] = set()

    def check_open(self) -> None:
        if self.closed:
            raise SessionClosed(f"session {self.id} was finalized or aborted; create a new one (POST /sessions)")

    def bridge_tokens(self, key: str) -> list[int] | None:
        """The tokens stored for the conversation prefix with canonical ``key`` (None if none is)."""
        hit = self._bridges.get(key)
        if hit is None:
            return None
        branch, end = hit
        return self.branches[branch].token_ids[:end]

    def remember(self, key: str, branch: int, end: int) -> None:
        self._bridges[key] = (branch, end)

    def commit(self, prompt: list[int], sampled: Sampled, record: TurnRecord) -> Branch:
        """Put ``prompt + sampled.ids`` on a branch (see the module docstring); ``record`` gets its positions."""
        seq = prompt + sampled.ids
        best, lcp = None, 0
        for b in self.branches:
            n = common_prefix(b.token_ids, seq)
            if best is None or (n, n == len(b.token_ids)) > (lcp, lcp == len(best.token_ids)):
                best, lcp = b, n
        p, end = len(prompt), len(seq)
        if best is not None and lcp == len(best.token_ids):
            branch = best  # grows
        elif best is not None and lcp == end and all(best.loss_mask[p:end]):
            branch = best  # nothing new: the same sampled tokens are there already
        else:
            branch = Branch(index=len(self.branches), parent=best.index if best and lcp else None,
                            fork_at=lcp if best else 0)
            shared = min(lcp, p)
            if best is not None:
                branch.token_ids = best.token_ids[:shared]
                branch.loss_mask = best.loss_mask[:shared]
                branch.logprobs = best.logprobs[:shared]
                branch.weight_versions = best.weight_versions[:shared]
                branch.turns = [t for t in best.turns if t.end <= shared]
            self.branches.append(branch)
        have = len(branch.token_ids)
        if have < end:  # new tokens: the prompt's with mask 0, the sampled ones with the engine's data
            new_prompt = max(0, p - have)
            branch.token_ids += seq[have:]
            branch.loss_mask += [0] * new_prompt + [1] * (end - max(have, p))
            branch.logprobs += [0.0] * new_prompt + sampled.logprobs[max(0, have - p):]
            branch.weight_versions += [-1] * new_prompt + sampled.weight_versions[max(0, have - p):]
        record.start, record.end = p, end
        branch.turns.append(record)
        self.last_branch = branch.index
        self._check(branch, seq, p, sampled, fresh=max(have, p))
        return branch

    @staticmethod
    def _check(branch: Branch, seq: list[int], p: int, sampled: Sampled, *, fresh: int) -> None:
        """The invariant; ``[fresh:len(seq))`` are the positions this commit wrote."""
        end = len(seq)
        if branch.token_ids[:end] != seq:
            raise ContinuityError(f"branch {branch.index}'s tokens are not the engine's prompt + sampled ids")
        if not (len(branch.token_ids) == len(branch.loss_mask) == len(branch.logprobs)
                == len(branch.weight_versions)):
            raise ContinuityError(f"branch {branch.index}'s per-token arrays differ in length")
        if branch.loss_mask[p:end] != [1] * (end - p):
            raise ContinuityError(f"branch {branch.index}: the sampled tokens [{p}:{end}) are not all mask 1")
        if (branch.logprobs[fresh:end] != sampled.logprobs[fresh - p:]
                or branch.weight_versions[fresh:end] != sampled.weight_versions[fresh - p:]):
            raise ContinuityError(f"branch {branch.index}: logprobs or versions of [{fresh}:{end}) are not the "
                                  "engine's")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "reward": self.reward, "finished": self.finished, "metrics": self.metrics,
                "metadata": self.metadata, "requests": self.requests, "replayed": self.replayed, "exhausted": self.exhausted,
                "branches": [b.to_json() for b in self.branches]}


class SessionStore:
    """The live sessions of one gateway, by id and by API key."""

    def __init__(self, *, replay_size: int = 64) -> None:
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}
        self.replay_size = replay_size

    def create(self, metadata: dict[str, Any] | None = None, *, limits: SessionLimits | None = None) -> Session:
        sid = secrets.token_hex(12)
        session = Session(sid, f"sk-agentrl-{secrets.token_urlsafe(18)}", metadata, replay_size=self.replay_size,
                          limits=limits)
        self._sessions[sid] = session
        self._by_key[session.api_key] = sid
        return session

    def get(self, sid: str) -> Session:
        try:
            return self._sessions[sid]
        except KeyError:
            raise SessionNotFound(f"no session {sid!r}; create one with POST /sessions") from None

    def by_key(self, api_key: str) -> Session:
        sid = self._by_key.get(api_key)
        if sid is None:
            raise SessionNotFound("the API key names no live session; use the api_key POST /sessions returned")
        return self.get(sid)

    def __len__(self) -> int:
        return len(self._sessions)

    async def close(self, sid: str) -> Session:
        """Stop taking requests, cancel the generations in flight (the engine client aborts them on the server),
        and forget the session; returns it, branches and all."""
        session = self.get(sid)
        session.closed = True
        tasks = [t for t in session.inflight if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        del self._sessions[sid]
        self._by_key.pop(session.api_key, None)
        return session
