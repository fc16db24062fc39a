"""Scope on vLLM: the gateway's key spans as one vLLM ``cache_salt``.

vLLM keys a prefix by ``cache_salt`` on its *first* block only; every later block
inherits it through the chained hash. So vLLM can express "these keys for the whole
prompt" and nothing finer. Cachepoint's key spans can say more: a global prefix
(shared by every tenant) followed by org-keyed blocks (contract §3, Scope). There are
two ways to fold that into one salt, and only one keeps isolation:

- salt with the org's keys: every block, the global prefix included, is org-private.
  Tenants stop sharing the prefix (each computes and caches its own copy) but nothing
  crosses between them. This is what the shim does.
- no salt for the global prefix: then the org blocks after it would be unsalted too,
  and one tenant's conversation could be read back by another sending the same tokens.
  That would weaken isolation, so it is never done.

`salt_keys` makes the first choice for any span list: the union of every span's keys
(the last span's first, in order, then any earlier key it lacks). Every key that
isolated any block now isolates all of them, so the fold is never weaker than the
spans it replaces. A prompt's blocks are then hashed, in kvcore's space too, as one
span under these keys: that is what the vLLM replica publishes and bills by.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from cachepoint.kvcore import ExtraKeys

SALT_PREFIX = "cachepoint/v1:"
"""Marks a salt as ours, so the events' extra keys decode back to kvcore keys."""


def salt_keys(spans: Sequence[tuple[int, Sequence[str]]]) -> ExtraKeys:
    """One key set for the whole prompt, at least as strict as every span."""
    if not spans:
        return ()
    keys = list(spans[-1][1])
    for _, earlier in spans[:-1]:
        keys.extend(k for k in earlier if k not in keys)
    return tuple(keys)


def narrowed(spans: Sequence[tuple[int, Sequence[str]]]) -> bool:
    """Whether folding ``spans`` into one salt stops some prefix being shared (a global
    prefix becomes org-private): the cache report says so."""
    return len({tuple(k) for _, k in spans}) > 1


def encode_salt(keys: ExtraKeys) -> str | None:
    """The ``cache_salt`` for ``keys``; None (no salt) when there are none."""
    if not keys:
        return None
    return SALT_PREFIX + json.dumps(list(keys), ensure_ascii=False, separators=(",", ":"))


def decode_salt(extra: Sequence[object] | None) -> ExtraKeys | None:
    """Our keys back from a vLLM event's extra keys for a first block.

    None when the block carries something we did not put there (a LoRA, multimodal
    inputs, a salt of someone else's): such a block is not ours to mirror.
    """
    if not extra:
        return ()
    if len(extra) != 1 or not isinstance(extra[0], str) or not extra[0].startswith(SALT_PREFIX):
        return None
    try:
        keys = json.loads(extra[0][len(SALT_PREFIX) :])
    except ValueError:
        return None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return None
    return tuple(keys)
