"""The replica's request log: one structured line per finished request."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from cachepoint.engine import Engine
from cachepoint.protocol import GenerateRequest
from cachepoint.replica.errors import CancelledRequestError
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.requestlog import RequestLog
from cachepoint.runtime.serve import JsonFormatter, TextFormatter

PROMPT = list(range(3, 103))
KEYS = {
    "request_id",
    "status",
    "error_type",
    "prompt_tokens",
    "engine_hit_tokens",
    "entry_hit_tokens",
    "written_5m_tokens",
    "written_1h_tokens",
    "output_tokens",
    "queue_s",
    "prefill_s",
    "decode_s",
}


@pytest.fixture
async def sched(engine: Engine, settings, sink):
    s = TorchCore(engine, settings, sink=sink, on_finish=RequestLog(settings.name))
    s.start()
    yield s
    await s.stop()


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "cachepoint.replica.requests"]


async def test_request_lines_carry_the_cache_report_and_timings(
    sched: TorchCore, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="cachepoint.replica")
    body = {"token_ids": PROMPT, "max_tokens": 4, "breakpoints": [{"position": 90, "ttl": "1h"}]}
    results = []
    for rid in ("first", "second"):
        seq = sched.submit(GenerateRequest(request_id=rid, **body))
        await asyncio.wait_for(seq.done, 30)
        results.append(sched.result(seq))
    records = _lines(caplog)
    assert [r.fields["request_id"] for r in records] == ["first", "second"]  # type: ignore[attr-defined]
    for record, result in zip(records, results, strict=True):
        line = record.fields  # type: ignore[attr-defined]
        assert line.keys() >= KEYS
        assert line["status"] == "ok" and line["error_type"] is None
        assert line["replica"] == "r-test"
        assert line["prompt_tokens"] == result.cache.prompt_tokens == len(PROMPT)
        assert line["engine_hit_tokens"] == result.cache.engine_hit_tokens
        assert line["entry_hit_tokens"] == result.cache.entry_hit_tokens
        assert line["written_5m_tokens"] == result.cache.written_5m_tokens
        assert line["written_1h_tokens"] == result.cache.written_1h_tokens
        assert line["output_tokens"] == result.output_tokens
        assert line["queue_s"] == pytest.approx(result.timings.queue_s, abs=1e-5)
        assert line["prefill_s"] == pytest.approx(result.timings.prefill_s, abs=1e-5)
        assert line["decode_s"] == pytest.approx(result.timings.decode_s, abs=1e-5)
    # The first wrote the 1h entry, the second read it: the log shows both sides.
    first, second = (r.fields for r in records)  # type: ignore[attr-defined]
    assert first["written_1h_tokens"] == 90 and first["entry_hit_tokens"] == 0
    assert second["entry_hit_tokens"] == 90 and second["engine_hit_tokens"] > 0
    # Rendered, each record is one JSON object on one line.
    rendered = JsonFormatter().format(records[1])
    assert "\n" not in rendered
    parsed = json.loads(rendered)
    assert parsed["msg"] == "request" and parsed["level"] == "info"
    assert {k: parsed[k] for k in KEYS} == {k: second[k] for k in KEYS}
    text = TextFormatter().format(records[1])
    assert '"request_id": "second"' in text


async def test_a_cancelled_request_is_logged_as_cancelled(
    sched: TorchCore, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="cachepoint.replica")
    seq = sched.submit(GenerateRequest(token_ids=PROMPT, max_tokens=500, ignore_eos=True))
    await asyncio.wait_for(seq.stream.get(), 30)  # past its prefill
    sched.cancel(seq)
    with pytest.raises(CancelledRequestError):
        await asyncio.wait_for(seq.done, 30)
    (record,) = _lines(caplog)
    line = record.fields  # type: ignore[attr-defined]
    assert line["status"] == "cancelled" and line["error_type"] == "cancelled"
    assert line["prompt_tokens"] == len(PROMPT)
    assert 1 <= line["output_tokens"] < 500
    assert line["decode_s"] > 0
