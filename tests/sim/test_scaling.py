"""`cachepoint sim scaling`: the event codec round-trips and the measurements are sane."""

from __future__ import annotations

import json
from pathlib import Path

from cachepoint.embedded.cli import main
from cachepoint.kvcore import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from cachepoint.sim.scaling import decode_events, encode_events

H = [BlockHash(bytes([i]) * 16) for i in range(4)]


def test_event_batches_round_trip_through_msgpack():
    events = [
        BlockStored((H[0], H[1]), None),
        BlockStored((H[2],), H[1]),
        BlockRemoved((H[0],)),
        AllBlocksCleared(),
    ]
    payload = encode_events("replica-3", 2, 17, 12.5, events)
    assert decode_events(payload) == events
    # five hashes (four in runs, one parent) at 16 bytes + a 2-byte bin header each,
    # a few bytes of tag per event, the tier's name on the three block events (at most
    # 7 bytes: "device"), and the batch's own fields
    framing = len(encode_events("replica-3", 2, 17, 12.5, []))
    assert framing < 64
    assert len(payload) <= framing + 5 * 18 + 4 * 12 + 3 * 7


def test_scaling_command_reports_measured_figures(trace_file: Path, capsys):
    args = ["--trace", str(trace_file), "--blocks", "20000", "--capacity-frac", "0.2", "--json"]
    assert main(["sim", "scaling", *args]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert 40 < figures["index_bytes_per_block"] < 400
    assert figures["apply_hashes_per_s"] > 1e5
    assert 16 < figures["wire_bytes_per_hash"] < 20
    replay = figures["replay"]
    assert replay["requests"] == 60
    assert replay["hashes_per_request"] > 0
    assert replay["bytes_per_request"] > 16 * replay["hashes_per_request"]
