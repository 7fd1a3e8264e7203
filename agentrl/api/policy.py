"""What a submission may point the server at: model servers only on allowed hosts, model folders only under
allowed roots (dataset files are held to ``dataset_dirs`` by :func:`agentrl.eval.datasets.load_tasks`).

Checked at submission, before anything is read or any connection tried; a refusal is a field error (422). Hosts
are matched as written in the URL, never resolved: an entry is a host name (case-insensitive), an IP address or
an IP network (``10.0.0.0/8``). The default list is the loopback names (``127.0.0.1``, ``::1``, ``localhost``),
so by default a submitter cannot make the server send requests into the network it sits in.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from agentrl.eval.base import SpecError
from agentrl.eval.spec import EvalSpec
from agentrl.models import NAMED_MODELS

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class SpecPolicy:
    """The server's limits on a spec's model; :meth:`check` raises :class:`SpecError` naming the field."""

    def __init__(self, *, model_hosts: Sequence[str], model_dirs: Sequence[Path]) -> None:
        self.names: set[str] = set()
        self.networks: list[Network] = []
        for entry in model_hosts:
            try:
                self.networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self.names.add(entry.lower().rstrip("."))
        self.hosts_text = ", ".join(model_hosts) or "none"
        self.roots = [d.expanduser().resolve() for d in model_dirs]

    def check(self, spec: EvalSpec) -> None:
        m = spec.model
        for field, url in (("url", m.url), ("openai_url", m.openai_url)):
            if url is not None and not self.host_allowed(urlsplit(url).hostname or ""):
                raise SpecError(("model", field), f"{urlsplit(url).hostname!r} is not on this server's list of model "
                                f"hosts ({self.hosts_text}); ask the operator to add it (model_hosts)")
        if m.path is not None:
            self._under_roots(("model", "path"), m.path)
        if m.tokenizer is not None and m.tokenizer not in NAMED_MODELS:
            p = Path(m.tokenizer).expanduser()
            if p.is_absolute() or m.tokenizer.startswith(".") or p.is_dir():  # a folder, not a Hub id
                self._under_roots(("model", "tokenizer"), m.tokenizer)

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        if host in self.names:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self.networks)

    def _under_roots(self, loc: tuple[str, ...], raw: str) -> None:
        try:
            resolved = Path(raw).expanduser().resolve(strict=False)
        except (OSError, RuntimeError, ValueError) as exc:
            raise SpecError(loc, f"{raw!r} cannot be resolved: {exc}") from None
        if not any(resolved.is_relative_to(r) for r in self.roots):
            raise SpecError(loc, f"{raw!r} is outside the directories this server reads models from "
                            f"({', '.join(map(str, self.roots)) or 'none'}); put the model there (model_dirs)")
