"""Who is calling: tenants (named bearer tokens with scopes) and the FastAPI dependencies that require a scope.

    tenants: [{name: team-a, token: …, scopes: [submit, read, cancel]}, {name: ops, token: …, scopes: [admin]}]

A request's bearer token names its tenant (tokens compared in constant time); no known token is a 401, a known
one without the route's scope a 403. A tenant's tasks are its own: the routes answer another tenant's task id
with 404, as they answer an unknown one, so ids are not revealed. ``admin`` holds every scope on every tenant's
tasks. With no tenant configured (no ``token``, no ``tenants``) the API is open and every caller is the admin
tenant ``default`` — what it was before tenants existed.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException

from agentrl.api.base import DEFAULT_TENANT, TOKEN_ENV, Scope, Tenant

_bearer = HTTPBearer(auto_error=False, description=f"a tenant's token (the shared one: {TOKEN_ENV}); required "
                                                   "when the server has tenants or a token")


@dataclass(frozen=True, slots=True)
class Principal:
    """The tenant a request acts as."""

    name: str
    scopes: frozenset[Scope]

    @property
    def admin(self) -> bool:
        return Scope.ADMIN in self.scopes

    def can(self, scope: Scope) -> bool:
        return self.admin or scope in self.scopes

    def owns(self, tenant: str) -> bool:
        """May act on a task of ``tenant``."""
        return self.admin or tenant == self.name

    @property
    def sees(self) -> str | None:
        """The tenant whose tasks a listing shows (None: every tenant's)."""
        return None if self.admin else self.name


class Authenticator:
    """Maps a bearer token to its tenant (see the module docstring)."""

    def __init__(self, tenants: Sequence[Tenant]) -> None:
        self.tenants = [(t.token.encode(), Principal(t.name, t.scopes)) for t in tenants]
        self.open = None if self.tenants else Principal(DEFAULT_TENANT, frozenset(Scope))

    def authenticate(self, token: str | None) -> Principal:
        if self.open is not None:
            return self.open
        given, found = (token or "").encode(), None
        for secret, principal in self.tenants:  # no early exit: the time does not depend on which token matched
            if hmac.compare_digest(given, secret):
                found = principal
        if found is None:
            raise HTTPException(401, f"missing or wrong bearer token (Authorization: Bearer <a tenant's token, or "
                                     f"{TOKEN_ENV}>)", headers={"WWW-Authenticate": "Bearer"})
        return found


def authenticated(request: Request,
                  creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
    """Dependency: the calling tenant (401 without a known token)."""
    auth: Authenticator = request.app.state.authenticator
    return auth.authenticate(creds.credentials if creds is not None else None)


def _requires(scope: Scope) -> Callable[..., Principal]:
    def check(p: Annotated[Principal, Depends(authenticated)]) -> Principal:
        if not p.can(scope):
            raise HTTPException(403, f"tenant {p.name!r} lacks the scope {scope.value!r} (it has "
                                     f"{sorted(s.value for s in p.scopes) or 'none'}); ask the operator")
        return p

    return check


Submitter = Annotated[Principal, Depends(_requires(Scope.SUBMIT))]
Reader = Annotated[Principal, Depends(_requires(Scope.READ))]
Canceller = Annotated[Principal, Depends(_requires(Scope.CANCEL))]
Admin = Annotated[Principal, Depends(_requires(Scope.ADMIN))]
