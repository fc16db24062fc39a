"""Key spans as one vLLM cache_salt: never weaker than the spans, and decodable."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cachepoint.replica.vllm_engine.scope import (
    SALT_PREFIX,
    decode_salt,
    encode_salt,
    narrowed,
    salt_keys,
)

MODEL, ORG, GLOBAL = "model:m", "org:org_1", "scope:global"


def test_an_org_request_keeps_its_keys_in_order() -> None:
    spans = [(0, [MODEL, ORG])]
    assert salt_keys(spans) == (MODEL, ORG)
    assert not narrowed(spans)


def test_a_global_prefix_becomes_org_private() -> None:
    # The gateway's global marker: the prefix under global keys, the rest under org keys.
    spans = [(0, [MODEL, GLOBAL]), (4, [MODEL, ORG])]
    keys = salt_keys(spans)
    assert keys == (MODEL, ORG, GLOBAL)
    assert narrowed(spans)


def test_no_spans_no_salt() -> None:
    assert salt_keys([]) == ()
    assert encode_salt(()) is None
    assert decode_salt(None) == ()


@given(
    st.lists(
        st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4), min_size=1, max_size=4
    )
)
def test_the_salt_holds_every_key_of_every_span_and_round_trips(key_lists: list) -> None:
    spans = [(i, keys) for i, keys in enumerate(key_lists)]
    keys = salt_keys(spans)
    # Never weaker: whatever isolated any block isolates all of them.
    assert all(k in keys for _, span in spans for k in span)
    salt = encode_salt(keys)
    assert salt is not None and salt.startswith(SALT_PREFIX)
    assert decode_salt((salt,)) == keys


def test_foreign_extra_keys_are_not_ours_to_mirror() -> None:
    assert decode_salt(("someone-elses-salt",)) is None
    assert decode_salt((SALT_PREFIX + "{not json",)) is None
    assert decode_salt((SALT_PREFIX + '["a"]', ("lora", "x"))) is None
    assert decode_salt((SALT_PREFIX + "[1, 2]",)) is None
