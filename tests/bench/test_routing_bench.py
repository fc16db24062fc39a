"""bench/routing_bench.py's arithmetic, without a stack: the turn text and the pooled rounds."""

from __future__ import annotations

from cachepoint.bench import routing_bench as rb


def test_a_turn_has_the_length_asked_for_and_is_the_sessions_own():
    a, b = rb.turn_text(0, 3, 160), rb.turn_text(1, 3, 160)
    assert len(a) == len(b) == 160
    assert a != b and a.startswith("session 0 question 3: ")
    assert rb.turn_text(0, 0, 5).startswith("session 0")  # shorter than the head: the head


def test_rounds_pool_into_sums_and_every_requests_ttft():
    runs = [
        {
            "billed_read": 100,
            "engine_hits": 120,
            "prompt": 1000,
            "ttft": [0.1, 0.2],
            "cost": 0.5,
            "wall": 4.0,
        },
        {
            "billed_read": 300,
            "engine_hits": 310,
            "prompt": 1000,
            "ttft": [0.3, 0.4, 1.0],
            "cost": 0.25,
            "wall": 5.0,
        },
    ]
    p = rb.pool(runs)
    assert (p["billed_read"], p["engine_hits"], p["prompt"], p["requests"]) == (400, 430, 2000, 5)
    assert p["cost"] == 0.75 and p["wall"] == 9.0
    assert p["ttft_p90"] == 0.4  # the 4th of 5 sorted (index int(0.9 * 4) = 3)
    assert abs(p["ttft_mean"] - 0.4) < 1e-12
    assert rb.p90([5.0, 1.0, 3.0]) == 3.0
