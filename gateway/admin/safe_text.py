"""Untrusted text made safe for an operator's terminal and spreadsheet.

Tenants choose some of what the admin CLI prints (``metadata.user_id``, session ids,
model names they send) and operators the rest (org, key and alias names). None of it
may drive the operator's terminal (escape sequences: clear screen, window title,
hyperlinks) or reorder what is shown (bidi overrides), and none of it may become a
formula when a CSV export is opened in a spreadsheet.
"""

from __future__ import annotations

import unicodedata

# NOTE: besides the C0/C1 controls and DEL (Unicode category Cc), the bidi embeddings,
# overrides and isolates reorder the text around them ("Trojan Source"), and the line
# and paragraph separators break a table row in renderers that honour them.
_INVISIBLE = frozenset(
    chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029)
)
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# OWASP's CSV-injection advice: a cell starting with one of these may be run as a formula.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def is_unsafe(ch: str) -> bool:
    """Whether one character may not reach a terminal or a CSV cell as it is."""
    return ch in _INVISIBLE or unicodedata.category(ch) == "Cc"


def _escape(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with every control character, DEL, bidi control and line separator
    written as a visible escape (ESC as the four characters ``\\x1b``, a newline as
    ``\\n``); everything else, non-ASCII letters included, unchanged.

    NOTE: a backslash is left as it is, so printable text comes back identical; the
    output is for reading, not for decoding."""
    if not any(is_unsafe(ch) for ch in text):
        return text
    return "".join(_escape(ch) if is_unsafe(ch) else ch for ch in text)


def csv_text(text: str) -> str:
    """A text cell for a CSV export: made visible, then quoted with a leading ``'`` if
    a spreadsheet would read it as a formula. Only for text: numbers the CLI writes
    itself (a negative saving) must stay numbers."""
    # NOTE: the check runs on the raw text too, since a leading tab or carriage return
    # is made visible as "\t" / "\r", which no longer starts with it.
    shown = visible(text)
    if text.startswith(_FORMULA_START) or shown.startswith(_FORMULA_START):
        return "'" + shown
    return shown
