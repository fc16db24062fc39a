"""Untrusted text made safe for the operator's terminal and CSV."""

from __future__ import annotations

import re
import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from cachepoint.gateway.admin.safe_text import csv_text, is_unsafe, visible

ESCAPE = re.compile(r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|n|r|t)")
BIDI = [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))]


def _control(ch: str) -> bool:
    """The property's own definition: C0, DEL, C1 (category Cc) and the bidi controls."""
    return unicodedata.category(ch) == "Cc" or ch in BIDI


# Printable text: no Cc, no bidi controls, no line/paragraph separators (Zl, Zp), no
# surrogates; letters of every script, marks, symbols, spaces and backslashes stay in.
printable = st.text(
    st.characters(
        blacklist_categories=("Cc", "Cs", "Zl", "Zp"),
        blacklist_characters="".join(BIDI),
    )
)


@given(st.text())
def test_visible_never_lets_a_control_character_through(text):
    shown = visible(text)
    assert not any(_control(ch) or is_unsafe(ch) for ch in shown)
    # Character by character: a safe one as it is, an unsafe one as a short escape.
    assert shown == "".join(visible(ch) for ch in text)
    for ch in text:
        if is_unsafe(ch):
            assert ESCAPE.fullmatch(visible(ch)), repr(ch)
        else:
            assert visible(ch) == ch


@given(printable)
def test_visible_is_the_identity_on_printable_text(text):
    assert visible(text) == text


@given(st.text(), st.text())
def test_visible_is_compositional(a, b):
    """Escaping works character by character: no sequence can straddle two inputs."""
    assert visible(a + b) == visible(a) + visible(b)


def test_visible_writes_escapes_as_text():
    assert visible("\x1b[2J\x1b]0;title\x07") == "\\x1b[2J\\x1b]0;title\\x07"
    assert visible("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert visible("\x00\x7f\x85\x9b") == "\\x00\\x7f\\x85\\x9b"
    assert visible("abc\u202edcb\u2066x\u2069") == "abc\\u202edcb\\u2066x\\u2069"
    assert visible("line\u2028sep") == "line\\u2028sep"
    # Ordinary text, non-ASCII letters and backslashes included, is left alone.
    for plain in ("José Ñúñez", "日本語のユーザー", "Ελληνικά", "user\\path", "[/b] :smile:"):
        assert visible(plain) == plain


def test_csv_text_neutralises_formulas():
    assert csv_text('=HYPERLINK("http://x","y")') == '\'=HYPERLINK("http://x","y")'
    for lead in ("=", "+", "-", "@"):
        assert csv_text(f"{lead}1+1") == f"'{lead}1+1"
    # A leading tab or carriage return is quoted and made visible.
    assert csv_text("\t=1") == "'\\t=1"
    assert csv_text("\r=1") == "'\\r=1"
    assert csv_text("x\x1b[31m") == "x\\x1b[31m"
    for plain in ("alice", "2026-01-01T00:00:00Z", "a=b", "José", "1-2"):
        assert csv_text(plain) == plain


@given(st.text())
def test_csv_text_never_starts_a_formula(text):
    cell = csv_text(text)
    assert not any(_control(ch) for ch in cell)
    assert not cell.startswith(("=", "+", "-", "@", "\t", "\r"))
    if not text.startswith(("=", "+", "-", "@", "\t", "\r")):
        assert cell == visible(text)
