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


# ----------------------------------------------------------------------- numerical safety

CPU = torch.device("cpu")


def _draw(logits: torch.Tensor, params: SamplingParams, n: int = 20) -> list[int]:
    gen = make_generator(params, CPU)
    return [sample(logits, [params], [gen])[0] for _ in range(n)]


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1e-300},
        {"temperature": 5e-324},  # the smallest positive double
        {"temperature": 1e-30},
        {"temperature": 1.0, "top_p": 1e-50},
        {"temperature": 1.0, "top_p": 5e-324},
        {"temperature": 1e-300, "top_p": 1e-50, "top_k": 1},
        {"temperature": 1.0, "top_k": 1},
    ],
)
def test_sample_extreme_values_that_pass_validation_pick_the_argmax(kw: dict[str, float]) -> None:
    """`top_p: 1e-50` and `temperature: 1e-300` raised inside sample() and killed the
    scheduler loop; each is a near-greedy setting, so the answer is the argmax."""
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(5)) * 3
    best = int(logits.argmax())
    params = SamplingParams(seed=7, **kw)  # type: ignore[arg-type]
    assert set(_draw(logits, params)) == {best}


def test_sample_survives_inf_and_nan_logits() -> None:
    params = SamplingParams(temperature=1.0, seed=2)
    nan, inf = float("nan"), float("inf")
    # NaN never wins; the one finite-but-large logit dominates.
    assert set(_draw(torch.tensor([[nan, 1.0, 50.0, -inf, nan]]), params)) == {2}
    # +inf is the certain choice (inf - inf must not turn into NaN).
    assert set(_draw(torch.tensor([[0.0, inf, 3.0, nan]]), params)) == {1}
    # Nothing finite at all: a degenerate row falls back to a valid token id, no error.
    for row in ([nan, nan, nan], [-inf, -inf, -inf], [nan, -inf, nan]):
        tokens = _draw(torch.tensor([row]), params, n=3)
        assert all(0 <= t < 3 for t in tokens)
    # Greedy rows ignore NaN too (torch.argmax alone would pick the NaN).
    assert sample(torch.tensor([[nan, 1.0, 2.0]]), [SamplingParams()], [None]) == [2]


def test_sample_float16_logits_at_tiny_temperature() -> None:
    logits = torch.tensor([[1.0, 2.0, 65504.0, -65504.0]], dtype=torch.float16)
    for t in (1e-300, 1e-8, 1.0, 2.0):
        params = SamplingParams(temperature=t, seed=1)
        assert set(_draw(logits, params, n=5)) == {2}


def test_sample_top_p_tiny_keeps_exactly_one_token_under_ties() -> None:
    logits = torch.zeros(1, 8)
    params = SamplingParams(temperature=1.0, top_p=1e-50, seed=9)
    assert len(set(_draw(logits, params, n=30))) == 1


def test_sample_is_still_seeded_after_the_safety_changes() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=123)
    first = _draw(logits, params, n=30)
    assert first == _draw(logits, params, n=30)
    assert len(set(first)) > 3  # really sampling, not collapsed to greedy


def test_sample_each_isolates_a_row_that_fails() -> None:
    from cachepoint.engine.sampling import sample_each

    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams()]

    bad = object()  # not a generator: torch.multinomial raises a TypeError for this row
    out = sample_each(logits, params, [None, bad, None])  # type: ignore[list-item]
    assert out[0] == int(logits[0].argmax())
    assert isinstance(out[1], TypeError)
    assert out[2] == int(logits[2].argmax())
    with pytest.raises(TypeError, match="generator"):  # sample() still raises for its callers
        sample(logits, params, [None, bad, None])  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [{"temperature": float("nan")}, {"temperature": float("inf")}])
def test_sampling_params_reject_non_finite_temperature(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        SamplingParams(**bad)  # type: ignore[arg-type]
