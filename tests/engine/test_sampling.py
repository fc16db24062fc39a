"""Token choice and stop strings."""

from __future__ import annotations

import pytest
import torch

from cachepoint.engine import ByteTokenizer, SamplingParams, StopChecker, sample
from cachepoint.engine.sampling import make_generator


def test_sample_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    greedy = SamplingParams()
    assert sample(logits, [greedy, greedy], [None, None]) == [1, 0]


def test_sample_top_p_keeps_only_the_nucleus() -> None:
    # Probabilities ~0.63, 0.23, 0.09, 0.03, ...: top_p 0.5 leaves only the first.
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    gen = make_generator(params, torch.device("cpu"))
    assert {sample(logits, [params], [gen])[0] for _ in range(50)} == {0}
    wider = SamplingParams(temperature=1.0, top_p=0.8, seed=3)
    gen = make_generator(wider, torch.device("cpu"))
    assert {sample(logits, [wider], [gen])[0] for _ in range(200)} == {0, 1}


def test_sample_top_k_keeps_only_k_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 7] = logits[0, 2] = 1.0
    params = SamplingParams(temperature=5.0, top_k=2, seed=4)
    gen = make_generator(params, torch.device("cpu"))
    assert {sample(logits, [params], [gen])[0] for _ in range(100)} == {2, 7}


def test_sample_seeded_rows_do_not_depend_on_neighbours() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=11)
    cpu = torch.device("cpu")
    alone = [sample(logits[1:2], [params], [make_generator(params, cpu)]) for _ in range(3)]
    batch = sample(
        logits,
        [SamplingParams(), params, SamplingParams(temperature=2.0, seed=1)],
        [None, make_generator(params, cpu), make_generator(params, cpu)],
    )
    assert alone[0] == alone[1] == alone[2] == [batch[1]]


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": -2},
    ],
)
def test_sampling_params_reject_bad_values(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_stop_checker_finds_a_stop_string_split_across_tokens() -> None:
    tok = ByteTokenizer()
    checker = StopChecker(tok, ["END", ""])
    hits = [checker.append(t) for t in tok.encode("abcEN")]
    assert hits == [None] * 5
    assert checker.append(ord("D")) == "END"
    assert checker.text == "abc"


def test_stop_checker_delta_holds_back_partial_stops_and_characters() -> None:
    tok = ByteTokenizer()
    checker = StopChecker(tok, ["STOP"])
    streamed = []
    for t in tok.encode("héllo ST"):
        checker.append(t)
        streamed.append(checker.delta())
    # "é" is two bytes: its first byte alone must not be streamed as U+FFFD.
    assert "\ufffd" not in "".join(streamed)
    assert "".join(streamed) == "héllo "  # "ST" may still become "STOP"
    for t in tok.encode("ARS"):
        checker.append(t)
    assert checker.delta() == "STAR"  # the last "S" may still start "STOP"
    assert checker.delta(final=True) == "S"
    assert checker.text == "héllo STARS"


def test_stop_checker_refuses_tokens_after_stopping() -> None:
    checker = StopChecker(ByteTokenizer(), ["x"])
    assert checker.append(ord("x")) == "x"
    with pytest.raises(RuntimeError, match="already stopped"):
        checker.append(ord("y"))
