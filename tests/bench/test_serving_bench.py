"""bench/serving_bench.py's arithmetic, without servers: percentiles, AIPerf's export,
the metrics breakdown and the ratios to vLLM (the figures bench/RESULTS.md quotes)."""

from __future__ import annotations

import json
import math

import pytest

from cachepoint.bench import serving_bench as sb


def test_percentiles_interpolate_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert sb.pct(xs, 0.5) == 2.5
    assert math.isclose(sb.pct(xs, 0.9), 3.7)
    assert math.isnan(sb.pct([], 0.5))


def test_aiperfs_export_is_read_in_seconds(tmp_path):
    export = {
        "records": {
            "time_to_first_token": {"unit": "ms", "avg": 2500.0, "p50": 2000.0, "p90": 4000.0},
            "request_latency": {"unit": "ms", "p50": 3000.0, "p90": 6000.0},
            "output_token_throughput": {"unit": "tokens/sec", "avg": 7.5},
            "request_count": {"unit": "requests", "avg": 12},
            "output_sequence_length": {"unit": "tokens", "avg": 16.0},
        }
    }
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "profile_export_aiperf.json").write_text(json.dumps(export))
    r = sb.parse_aiperf("torch", 2, tmp_path, 10.0)
    assert (r.ttft_p50_s, r.ttft_p90_s, r.latency_p90_s) == (2.0, 4.0, 6.0)
    assert (r.output_tok_s, r.requests, r.failed) == (7.5, 12, 0)
    assert r.extra["output_tokens_mean"] == 16.0


def test_the_breakdown_is_the_mean_of_one_loads_observations():
    before = {"cachepoint_ttft_seconds": (10.0, 4.0)}
    after = {"cachepoint_ttft_seconds": (16.0, 6.0), "cachepoint_decode_seconds": (3.0, 2.0)}
    assert sb.breakdown(before, after) == {
        "cachepoint_ttft_seconds": 3.0,
        "cachepoint_decode_seconds": 1.5,
    }


def test_ratios_are_to_vllm_per_load_and_concurrency():
    def res(server, ttft, tok):
        return sb.LoadResult(server, "agent", 2, ttft, ttft * 2, ttft * 3, ttft * 3, tok, 4)

    rows = sb.ratios([res("vllm", 2.0, 10.0), res("torch", 1.0, 12.0)])
    torch = next(r for r in rows if r["server"] == "torch")
    assert torch["vs_vllm"] == {
        "ttft_p50_s": 0.5,
        "ttft_p90_s": 0.5,
        "latency_p90_s": 0.5,
        "output_tok_s": 1.2,
    }
    assert "vs_vllm" not in next(r for r in rows if r["server"] == "vllm")
    assert "torch" in sb.render(rows)


def test_aiperf_drives_the_messages_api_without_scraping_the_server(tmp_path):
    """AIPerf's /metrics scraping (on by default) loaded `vllm serve`'s API process and
    not Cachepoint's (whose /metrics is private): the bench turns it off for both."""
    args = sb.build_parser().parse_args([])
    server = sb.Server("vllm", "http://127.0.0.1:9", "key")
    argv = sb.aiperf_argv(server, 4, args, tmp_path / "model", tmp_path / "out")
    assert "--no-server-metrics" in argv
    at = argv.index
    assert argv[at("--endpoint-type") + 1] == "messages" and "--streaming" in argv
    assert argv[at("--concurrency") + 1] == "4"
    assert argv[at("--url") + 1] == "http://127.0.0.1:9"
    assert argv[at("--shared-system-prompt-length") + 1] == str(args.aiperf_system_tokens)


def test_rounds_that_kept_their_requests_pool_them_for_percentiles():
    """Two rounds of 10 requests: the pooled p90 is over all 20, not a median of two p90s."""

    def res(ttfts, tok):
        reqs = [
            {"session": 0, "turn": i, "ttft_s": t, "latency_s": 2 * t} for i, t in enumerate(ttfts)
        ]
        return sb.LoadResult(
            "torch",
            "agent",
            2,
            sb.pct(ttfts, 0.5),
            sb.pct(ttfts, 0.9),
            sb.pct([2 * t for t in ttfts], 0.5),
            sb.pct([2 * t for t in ttfts], 0.9),
            tok,
            len(ttfts),
            extra={"requests": reqs},
        )

    a = res([1.0] * 9 + [10.0], 10.0)
    b = res([1.0] * 10, 14.0)
    p = sb.pooled([a, b])
    assert p["ttft_p90_s"] == sb.pct([1.0] * 19 + [10.0], 0.9)
    assert p["latency_p90_s"] == sb.pct([2.0] * 19 + [20.0], 0.9)
    assert p["ttft_p50_s"] == 1.0
    assert p["output_tok_s"] == 12.0  # throughput: the median over rounds
    # Without kept requests (AIPerf's rounds), the median over rounds.
    a.extra, b.extra = {}, {}
    assert sb.pooled([a, b])["ttft_p90_s"] == (a.ttft_p90_s + b.ttft_p90_s) / 2


def test_a_spin_count_that_is_not_a_number_is_refused_before_any_server_starts(capsys):
    with pytest.raises(SystemExit) as exc:
        sb.main(["--servers", "torch", "--loads", "agent", "--gomp-spincount", "lots"])
    assert exc.value.code == 2
    assert "--gomp-spincount: 'default' or a number, not 'lots'" in capsys.readouterr().err
