"""bench/serving_bench.py's arithmetic, without servers: percentiles, AIPerf's export,
the metrics breakdown and the ratios to vLLM (the figures bench/RESULTS.md quotes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

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
    assert r.extra["requests"] == []  # no per-request export: the summary's figures stand


def test_aiperfs_per_request_export_is_kept_for_pooling_and_pairing(tmp_path):
    """profile_export.jsonl as AIPerf 0.13 writes it (MetricRecordInfo): profiling
    records only, failed requests and warm-up left out, times in seconds."""

    def rec(conv, turn, ttft_ms, lat_ms, phase="profiling", error=None, start_ms=0.0):
        return {
            "metadata": {
                "session_num": 0,
                "conversation_id": conv,
                "turn_index": turn,
                "benchmark_phase": phase,
                "request_start_ns": 1_700_000_000_000_000_000 + int(start_ms * 1_000_000),
            },
            "metrics": {
                "time_to_first_token": {"value": ttft_ms, "unit": "ms"},
                "request_latency": {"value": lat_ms, "unit": "ms"},
                "output_sequence_length": {"value": 16, "unit": "tokens"},
            },
            "error": error,
        }

    out = tmp_path / "x"
    out.mkdir()
    (out / "profile_export_aiperf.json").write_text(json.dumps({"records": {}}))
    lines = [
        rec("session_000001", 0, 3000.0, 9000.0, start_ms=4.0),
        rec("session_000000", 1, 500.0, 2500.0, start_ms=6250.0),
        rec("session_000000", 0, 2000.0, 6000.0, start_ms=250.0),
        rec("session_000000", 0, 1.0, 2.0, phase="warmup"),
        rec("session_000002", 0, 1.0, 2.0, error={"code": 500, "message": "boom"}),
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\n{not json\n"
    (out / "profile_export.jsonl").write_text(text)
    r = sb.parse_aiperf("vllm", 2, tmp_path, 10.0)
    # starts are seconds from the first kept request's (the warm-up's do not count)
    assert r.extra["requests"] == [
        {"session": "session_000000", "turn": 0, "ttft_s": 2.0, "latency_s": 6.0, "start_s": 0.246},
        {"session": "session_000000", "turn": 1, "ttft_s": 0.5, "latency_s": 2.5, "start_s": 6.246},
        {"session": "session_000001", "turn": 0, "ttft_s": 3.0, "latency_s": 9.0, "start_s": 0.0},
    ]
    # kept requests make AIPerf's percentiles pooled over rounds, as the agent load's
    assert sb.pooled([r, r])["ttft_p90_s"] == sb.pct([2.0, 0.5, 3.0] * 2, 0.9)


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
    argv = sb.aiperf_argv(server, 4, args, tmp_path / "model", tmp_path / "out", 1004)
    assert "--no-server-metrics" in argv
    # each load its own prompts (the round's and concurrency's seed), the same for every
    # server: a load does not find the last one's prompts cached, and requests pair
    assert argv[argv.index("--random-seed") + 1] == "1004"
    at = argv.index
    assert argv[at("--endpoint-type") + 1] == "messages" and "--streaming" in argv
    assert argv[at("--concurrency") + 1] == "4"
    assert argv[at("--url") + 1] == "http://127.0.0.1:9"
    assert argv[at("--shared-system-prompt-length") + 1] == str(args.aiperf_system_tokens)


def test_aiperf_is_paced_so_its_timing_manager_does_not_spin_a_core(tmp_path):
    """In plain concurrency mode AIPerf's timing manager busy-waits for a free slot (a
    whole core of this 2-core machine): by default the bench adds a constant request
    rate, which makes it sleep between ticks while --concurrency still caps what is in
    flight; --aiperf-pace 0 gives AIPerf's plain mode back."""
    server = sb.Server("vllm", "http://127.0.0.1:9", "key")
    paced = sb.aiperf_argv(
        server, 2, sb.build_parser().parse_args([]), tmp_path, tmp_path / "out", 2
    )
    assert paced[paced.index("--request-rate") + 1] == "50.0"
    assert paced[paced.index("--arrival-pattern") + 1] == "constant"
    assert paced[paced.index("--concurrency") + 1] == "2"
    plain = sb.aiperf_argv(
        server, 2, sb.build_parser().parse_args(["--aiperf-pace", "0"]), tmp_path, tmp_path, 2
    )
    assert "--request-rate" not in plain and "--arrival-pattern" not in plain


def test_a_negative_pace_is_refused_before_any_server_starts(capsys):
    with pytest.raises(SystemExit) as exc:
        sb.main(["--aiperf-pace", "-1", "--loads", "agent", "--servers", "torch"])
    assert exc.value.code == 2
    assert "--aiperf-pace" in capsys.readouterr().err


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


def _agent(server, rnd, ttfts, wall=10.0, conc=2):
    reqs = [
        {"session": i % conc, "turn": i // conc, "ttft_s": t, "latency_s": 3 * t}
        for i, t in enumerate(ttfts)
    ]
    return sb.LoadResult(
        server,
        "agent",
        conc,
        0.0,
        0.0,
        0.0,
        0.0,
        1.0,
        len(reqs),
        wall_s=wall,
        extra={"requests": reqs, "round": rnd},
    )


def test_paired_compares_each_request_with_the_same_request_on_vllm():
    """Requests 10 % slower than their own twins on vLLM are 1.10x with a tight interval,
    whatever mode (first turn or later) each request is in: the pairing removes it."""
    base0 = [3.0, 3.1, 0.3, 0.4, 0.5, 0.2]
    base1 = [2.5, 2.9, 0.6, 0.1, 0.3, 0.35]
    results = [
        _agent("vllm", 0, base0, wall=20.0),
        _agent("vllm", 1, base1, wall=30.0),
        _agent("cp-vllm", 0, [1.1 * t for t in base0], wall=22.0),
        _agent("cp-vllm", 1, [1.1 * t for t in base1], wall=33.0),
    ]
    (row,) = sb.paired(results)
    assert (row["concurrency"], row["server"], row["pairs"]) == (2, "cp-vllm", 12)
    for f in ("ttft_s", "latency_s"):
        g, lo, hi = row[f]
        assert math.isclose(g, 1.1) and math.isclose(lo, 1.1) and math.isclose(hi, 1.1)
    assert math.isclose(row["wall"], 55.0 / 50.0)
    assert sb.verdict(*row["ttft_s"][1:]) == "worse"
    table = sb.render_paired([row])
    assert "agent  | 2 | cp-vllm |    12 | 1.10x [1.10-1.10] worse" in table
    assert table.rstrip().endswith("| 1.10x")


def test_paired_matches_on_the_round_not_on_position():
    """Round 1's prompts are not round 0's: a request is compared with its own round's."""
    results = [
        _agent("vllm", 0, [1.0, 1.0]),
        _agent("vllm", 1, [4.0, 4.0]),
        _agent("cp-vllm", 1, [4.0, 4.0]),  # level with round 1, 4x round 0
        _agent("cp-vllm", 0, [1.0, 1.0]),
    ]
    (row,) = sb.paired(results)
    assert row["ttft_s"] == (1.0, 1.0, 1.0)
    assert sb.verdict(*row["ttft_s"][1:]) == "within 5%"
    # A server without vLLM in the run, or a request vLLM never answered, is not paired.
    assert sb.paired([_agent("cp-vllm", 0, [1.0])]) == []


def test_verdicts_say_when_the_interval_cannot_tell():
    assert sb.verdict(0.90, 1.04) == "within 5%"
    assert sb.verdict(0.95, 1.20) == "undecided"
    assert sb.verdict(1.06, 1.30) == "worse"
    # throughput: higher is better, so 0.97-1.10x is within 5 %
    assert sb.verdict(0.97, 1.10, higher_is_better=True) == "within 5%"
    assert sb.verdict(0.80, 0.90, higher_is_better=True) == "worse"


def test_from_json_reprints_a_saved_run_without_starting_a_server(tmp_path, capsys):
    from dataclasses import asdict

    results = [_agent("vllm", 0, [1.0, 2.0]), _agent("cp-vllm", 0, [1.0, 2.0])]
    for r in results:
        del r.extra["round"]  # files written before rounds were kept
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"results": [asdict(r) for r in results]}))
    assert sb.main(["--from-json", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "agent  | 2 | cp-vllm |" in out
    assert "1.00x [1.00-1.00] within 5%" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        sb.main(["--from-json", str(bad)])
    assert exc.value.code == 2
    assert "not a serving_bench --json file" in capsys.readouterr().err


def test_from_json_pools_several_runs_pairing_within_each_run(tmp_path, capsys):
    """Both files have a round 0 with different prompts: pooled, each request is still
    compared with its own run's twin (1.00x), not the other run's (4x or 0.25x)."""
    from dataclasses import asdict

    paths = []
    for name, ttft in (("a.json", 1.0), ("b.json", 4.0)):
        run = [_agent("vllm", 0, [ttft, ttft]), _agent("cp-vllm", 0, [ttft, ttft])]
        path = tmp_path / name
        path.write_text(json.dumps({"results": [asdict(r) for r in run]}))
        paths.append(str(path))
    assert sb.main(["--from-json", *paths]) == 0
    out = capsys.readouterr().out
    assert "agent  | 2 | cp-vllm |     4 | 1.00x [1.00-1.00] within 5%" in out
    with pytest.raises(SystemExit) as exc:
        sb.main(["--from-json", paths[0], str(tmp_path / "missing.json")])
    assert exc.value.code == 2
    assert "missing.json: not a serving_bench --json file" in capsys.readouterr().err


def test_cp_block_size_reaches_cachepoint_up_and_a_bad_one_is_refused(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(sb, "cachepoint_up", lambda *a: seen.append(a) or "server")
    assert sb.start("cp-vllm", Path("."), 1, Path("."), 128) == "server"
    assert sb.start("torch", Path("."), 1, Path(".")) == "server"
    assert [(a[0], a[3]) for a in seen] == [("vllm", 128), ("torch", None)]
    with pytest.raises(SystemExit) as exc:
        sb.main(["--servers", "cp-vllm", "--loads", "agent", "--cp-block-size", "0"])
    assert exc.value.code == 2
    assert "--cp-block-size" in capsys.readouterr().err


def test_the_cpu_table_is_per_request_by_process_over_rounds(capsys):
    def res(server: str, r: int, cpu: dict[str, float], busy: float) -> sb.LoadResult:
        return sb.LoadResult(
            server, "agent", 4, 1, 2, 3, 4, 5, 10,
            extra={"round": r, "cpu_s": cpu, "machine_busy": busy},
        )  # fmt: skip

    small = {"serve/python": 1.0, "bench/python": 2.0}
    results = [
        res("vllm", 0, {"serve/VLLM::EngineCor": 30.0, **small}, 0.9),
        res("vllm", 1, {"serve/VLLM::EngineCor": 50.0, **small}, 0.95),
        res("cp-vllm", 0, {"replica-0/VLLM::EngineCor": 41.0, "gateway/python": 3.0}, 0.99),
        # a round from a file written before the account existed: left out
        sb.LoadResult("cp-vllm", "agent", 4, 1, 2, 3, 4, 5, 10, extra={"round": 1}),
    ]
    rows = {r["server"]: r for r in sb.cpu_rows(results)}
    assert rows["vllm"]["per_request_s"] == {
        "serve/VLLM::EngineCor": 4.0, "bench/python": 0.2, "serve/python": 0.1
    }  # fmt: skip
    assert rows["vllm"]["server_s"] == 4.1  # the load generator is not the server's
    assert rows["vllm"]["machine_busy"] == 0.925
    assert rows["cp-vllm"]["per_request_s"] == {
        "replica-0/VLLM::EngineCor": 4.1, "gateway/python": 0.3
    }  # fmt: skip
    assert rows["vllm"]["prompt_tokens"] is None  # no usage recorded: no token columns
    table = sb.report(results)
    assert "server CPU s/request" in table
    assert "gateway/python 0.30" in table


def test_the_cpu_table_sets_the_prefill_beside_the_cpu():
    def q(inp: int, read: int, write: int) -> dict:
        return {"ttft_s": 1.0, "latency_s": 2.0, "input_tokens": inp,
                "cache_read_tokens": read, "cache_write_tokens": write}  # fmt: skip

    r = sb.LoadResult(
        "cp-vllm", "agent", 2, 1, 2, 3, 4, 5, 2,
        extra={"round": 0, "cpu_s": {"gateway/python": 1.0}, "machine_busy": 0.5,
               "requests": [q(10, 0, 2000), q(150, 2000, 0)]},
    )  # fmt: skip
    (row,) = sb.cpu_rows([r])
    # not read = uncached input + written (both prefilled on vLLM); prompt adds the reads
    assert (row["prompt_tokens"], row["not_read_tokens"]) == (2080, 1080)
    assert "2080, 1080" in sb.render_cpu([row])


def test_usage_buckets_read_both_servers_usages():
    class Usage:  # vLLM's: no write bucket, reads only with prompt tokens details on
        input_tokens, cache_read_input_tokens = 40, 2048

    assert sb.buckets(Usage()) == {
        "input_tokens": 40, "cache_read_tokens": 2048, "cache_write_tokens": 0
    }  # fmt: skip


class _FakeStream:
    """What agent_load reads of the SDK's message stream: events, then the message."""

    def __init__(self) -> None:
        from types import SimpleNamespace as NS

        self.final = NS(
            content=[NS(type="text", text="done")],
            stop_reason="end_turn",
            usage=NS(output_tokens=4, input_tokens=10, cache_read_input_tokens=100,
                     cache_creation_input_tokens=0),
        )  # fmt: skip

    def __enter__(self):
        return self

    def __iter__(self):
        from types import SimpleNamespace as NS

        return iter([NS(type="content_block_delta")])

    def __exit__(self, *exc):
        return False

    def get_final_message(self):
        return self.final


def _agent_run(
    monkeypatch, think_s: float, seed: int, session_block: str = "user"
) -> tuple[list[tuple[int, float]], sb.LoadResult, list[dict]]:
    import argparse
    import copy
    import threading
    from types import SimpleNamespace as NS

    pauses: list[tuple[int, float]] = []
    sent: list[dict] = []  # every request's keywords, as the SDK got them

    def stream(**kw):
        sent.append(copy.deepcopy(kw))
        return _FakeStream()

    class Client:
        def __init__(self, **kw) -> None:
            self.messages = NS(stream=stream)

    def fake_sleep(s: float) -> None:
        pauses.append((threading.get_ident(), s))

    monkeypatch.setattr(sb.anthropic, "Anthropic", Client)
    monkeypatch.setattr(sb.time, "sleep", fake_sleep)
    args = argparse.Namespace(
        system_tokens=50, turns=3, max_tokens=4, turn_tokens=20, think_s=think_s,
        session_block=session_block,
    )  # fmt: skip
    res = sb.agent_load(sb.Server("cp-vllm", "http://x", "k"), 2, args, seed)
    return pauses, res, sent


def test_think_time_pauses_between_turns_the_same_for_every_server(monkeypatch):
    pauses, res, _ = _agent_run(monkeypatch, 1.0, seed=7)
    assert res.requests == 6 and res.failed == 0
    # two sessions x (3 turns - 1): no pause after a session's last answer
    assert len(pauses) == 4
    assert all(0 <= s <= 1.0 for _, s in pauses)
    again, _, _ = _agent_run(monkeypatch, 1.0, seed=7)
    assert sorted(s for _, s in again) == sorted(s for _, s in pauses)  # same round, same pauses
    other, _, _ = _agent_run(monkeypatch, 1.0, seed=8)
    assert sorted(s for _, s in other) != sorted(s for _, s in pauses)
    none, res, _ = _agent_run(monkeypatch, 0.0, seed=7)
    assert none == [] and res.requests == 6
    # the usage is kept per request for the prefill columns, and the answer's length
    first = res.extra["requests"][0]
    assert first["cache_read_tokens"] == 100
    assert first["output_tokens"] == 4 and first["stop_reason"] == "end_turn"


def test_the_session_block_is_one_text_block_with_the_task_so_both_servers_see_the_same_tokens(
    monkeypatch,
):
    # NOTE: `vllm serve` joins system blocks with "" and Cachepoint with a blank line:
    # a second system block would render as two different prompts.
    def first_turn(sent: list[dict], in_system: bool) -> dict:
        """Session 0's first request (the sessions are threads: any order)."""
        return next(
            kw
            for kw in sent
            if len(kw["messages"]) == 1
            and (kw["system"][-1] if in_system else kw["messages"][0]["content"][0])[
                "text"
            ].startswith("Session 0.")
        )

    _, res, sent = _agent_run(monkeypatch, 0.0, seed=7)
    assert res.failed == 0
    first = first_turn(sent, in_system=False)
    assert len(first["system"]) == 1 and first["system"][0]["cache_control"]
    (block,) = first["messages"][0]["content"]
    own, task = block["text"].split("\n\n")
    assert task.startswith("Task: ")
    assert block["cache_control"] == {"type": "ephemeral"}  # the last message's marker
    # the older layout, kept to reproduce earlier runs: the same words, a second block
    _, _, old = _agent_run(monkeypatch, 0.0, seed=7, session_block="system")
    first_old = first_turn(old, in_system=True)
    assert [b["text"] for b in first_old["system"]] == [first["system"][0]["text"], own]
    assert first_old["messages"][0]["content"][0]["text"] == task


def test_in_step_counts_later_turns_sent_together():
    def q(session: int, turn: int, start: float) -> dict:
        return {"session": session, "turn": turn, "start_s": start, "ttft_s": 1.0, "latency_s": 1.0}

    reqs = [
        q(0, 0, 0.0), q(1, 0, 0.0), q(2, 0, 0.0),  # first turns: not counted
        q(0, 1, 5.00), q(1, 1, 5.03), q(2, 1, 6.0),  # 0 and 1 in step, 2 apart
        q(0, 2, 9.0), q(1, 2, 9.5), q(2, 2, 12.0),  # none
    ]  # fmt: skip
    r = sb.LoadResult("vllm", "agent", 3, 1, 2, 3, 4, 5, 9, extra={"round": 0, "requests": reqs})
    assert sb.in_step([r]) == round(2 / 6, 2)
    assert sb.in_step([sb.LoadResult("vllm", "aiperf", 3, 1, 2, 3, 4, 5, 9)]) is None
