"""Model aliases: the names clients send (``claude-sonnet-4-5``) -> a served model id.

Two sources, merged per name: the gateway's ``model_aliases`` setting and the
``model_aliases`` table (``cachepoint-admin models alias``); the table wins for the
same name. A name may end in one ``*`` (a prefix pattern); ``*`` alone is the
default. A request's model resolves as: a served model id is itself; else an exact
alias; else the longest matching prefix pattern; else ``*``; else 404.

What the lookup needs of the app's state is spelled out by :class:`AliasSource` (the
gateway's state satisfies it), so this module sits below the state and its settings,
which validate configured aliases with :func:`check_alias`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol
from weakref import WeakKeyDictionary

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from cachepoint.gateway.db.models import ModelAlias
from cachepoint.gateway.errors import not_found

MAX_NAME = 256  # the table's column width


def check_alias(name: str) -> str:
    """An alias name or pattern: non-empty, printable, at most one ``*``, at the end."""
    if not name or len(name) > MAX_NAME or not name.isprintable() or name != name.strip():
        raise ValueError(f"alias {name!r}: 1 to {MAX_NAME} printable characters, no spaces")
    if "*" in name[:-1]:
        raise ValueError(f"alias {name!r}: '*' may only end a pattern (e.g. 'claude-*' or '*')")
    return name


def check_target(model: str) -> str:
    """A served model id an alias points at: a concrete name, never a pattern."""
    if not model or len(model) > MAX_NAME or "*" in model or model != model.strip():
        raise ValueError(f"model {model!r}: a served model id (no '*', no spaces)")
    return model


def match(table: Mapping[str, str], model: str) -> str | None:
    """The target of the alias that ``model`` matches: exact beats the longest prefix
    pattern beats ``*``."""
    if model in table:
        return table[model]
    patterns = [n for n in table if n.endswith("*") and model.startswith(n[:-1])]
    return table[max(patterns, key=len)] if patterns else None


def concrete(table: Mapping[str, str]) -> dict[str, str]:
    """The aliases that are names, not patterns: what /v1/models lists."""
    return {k: v for k, v in table.items() if not k.endswith("*")}


class AliasSettings(Protocol):
    """The settings an alias lookup reads."""

    @property
    def model_aliases(self) -> Mapping[str, str]:
        """Configured aliases (the database's override them per name)."""
        ...

    @property
    def auth_cache_seconds(self) -> float:
        """How long the database's aliases, once read, are reused."""
        ...


class AliasSource(Protocol):
    """What resolving a model name needs of the app's state."""

    @property
    def sessions(self) -> sessionmaker[Session]:
        """The database the ``model_aliases`` table lives in."""
        ...

    @property
    def settings(self) -> AliasSettings:
        """Configured aliases and how long the table's are cached."""
        ...

    def models(self) -> list[str]:
        """The served model ids."""
        ...


def load(session: Session) -> dict[str, str]:
    return {a.alias: a.model for a in session.scalars(select(ModelAlias))}


@dataclass(slots=True)
class _Cached:
    table: dict[str, str] = field(default_factory=dict)  # the DB's aliases, as last read
    expires: float = 0.0  # monotonic time after which the table is read again


# NOTE: keyed by the state's sessionmaker (one per database handle) because the state
# is a slotted dataclass another module owns; the entry dies with the app.
_CACHE: WeakKeyDictionary[sessionmaker[Session], _Cached] = WeakKeyDictionary()


async def table(state: AliasSource) -> dict[str, str]:
    """Settings aliases overridden by the database's, the latter read at most once per
    ``auth_cache_seconds``, so an admin's change takes effect within that without a
    restart (like key revocation and prices)."""
    cached = _CACHE.get(state.sessions)
    now = time.monotonic()
    if cached is None or cached.expires <= now:

        def read() -> dict[str, str]:
            with state.sessions() as session:
                return load(session)

        cached = _Cached(await run_in_threadpool(read), now + state.settings.auth_cache_seconds)
        _CACHE[state.sessions] = cached
    return {**state.settings.model_aliases, **cached.table}


async def resolve(state: AliasSource, model: str) -> str:
    """The served model id for a request's ``model``; 404 ``not_found_error`` when no
    served model and no alias matches, or the alias points at a model not served."""
    served = state.models()
    if model in served:
        return model
    target = match(await table(state), model)
    if target is None or target not in served:
        raise not_found(f"model: {model}")
    return target
