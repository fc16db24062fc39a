"""The replica announces itself (its first heartbeat puts it in routing) only once its
HTTP server accepts connections: `NatsBus(listening=...)`, over a real nats-server."""

from __future__ import annotations

import asyncio
import time

import nats

from cachepoint.engine import Engine
from cachepoint.events import schema
from cachepoint.events.subjects import HEARTBEAT
from cachepoint.replica.bus import NatsBus
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.settings import ReplicaSettings


async def test_no_heartbeat_nor_announce_before_the_server_listens(engine: Engine, nats_server):
    scheduler = TorchCore(engine, ReplicaSettings(name="r-announce"))
    listening = asyncio.Event()
    bus = NatsBus(
        scheduler,
        nats_server.url,
        "http://r-announce",
        heartbeat_interval_s=0.05,
        listening=listening,
    )
    beats: list[float] = []
    nc = await nats.connect(nats_server.url)

    async def on_beat(msg) -> None:
        if schema.decode(msg.data, schema.Heartbeat).name == "r-announce":
            beats.append(time.monotonic())

    await nc.subscribe(f"{HEARTBEAT}.>", cb=on_beat)
    await nc.flush()
    scheduler.start()
    await bus.start()
    try:
        deadline = time.monotonic() + 10
        while bus.nc is None or not bus.nc.is_connected:
            assert time.monotonic() < deadline, "the bus never connected"
            await asyncio.sleep(0.02)
        await bus.announce()  # a drain that begins this early says nothing either
        await asyncio.sleep(0.5)  # ten heartbeat intervals, connected
        assert beats == []
        assert not bus.serving
        listening.set()
        set_at = time.monotonic()
        while not beats:
            assert time.monotonic() < set_at + 5, "no heartbeat once listening"
            await asyncio.sleep(0.01)
        assert bus.serving
        assert beats[0] - set_at < 1.0
    finally:
        await bus.stop()
        await scheduler.stop()
        await nc.close()
