"""When a turn ends: the one rule both engines' cores apply to each sampled token."""

from __future__ import annotations

from dataclasses import dataclass

from cachepoint.replica.sequence import SequenceState, TokenEvent


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """The ids and limits that end a turn on one replica."""

    eos_ids: frozenset[int]  # every id that ends a turn unless the request ignores EOS
    eos_id: int | None  # the one the random model "samples" to end its turn
    random_turn: int = 0  # the random model's turn length in tokens; 0 = none


def append_token(seq: SequenceState, token: int, end: TurnEnd) -> bool:
    """Append a sampled token, stream the text it makes safe, and decide whether the turn
    is over (``seq.stop_reason`` set). Returns True when it is."""
    if (
        end.random_turn
        and end.eos_id is not None
        and not seq.params.ignore_eos
        and len(seq.output) + 1 >= end.random_turn
    ):
        # NOTE: the random model "samples" EOS here: a turn that ends as a real
        # model's does (end_turn, EOS as the last token), not a max_tokens stop.
        token = end.eos_id
    seq.output.append(token)
    if (token in end.eos_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
        seq.stop_reason = "end_turn"
    elif seq.stopper.append(token) is not None:
        seq.stop_reason = "stop_sequence"
    elif len(seq.output) >= seq.params.max_tokens or seq.context_full:
        seq.stop_reason = "max_tokens"
    final = seq.stop_reason is not None
    seq.stream.put_nowait(TokenEvent(token, seq.stopper.delta(final=final)))
    return final
