"""PrefixIndex: the router's view of one replica's cache, built only from its events."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .hashing import BlockHash
from .tier import Tier


@dataclass(frozen=True, slots=True)
class TierMatch:
    """Where the leading run of a prompt's blocks lives on one replica.

    The replica hits its device run first, then the run right after it found in
    its lower tiers (promoted before prefill), and stops at the first block it holds
    in neither: ``device`` counts the first run, ``host`` and ``disk`` split the second.
    """

    device: int = 0  # leading blocks held on the device
    host: int = 0  # blocks right after the device run, held in host memory
    disk: int = 0  # blocks right after the device run, held on local disk

    @property
    def blocks(self) -> int:
        """Every block the replica would hit, whatever its tier."""
        return self.device + self.host + self.disk

    @property
    def lower(self) -> int:
        """Blocks the replica would promote before prefill."""
        return self.host + self.disk


_DEVICE = Tier.DEVICE

NO_MATCH = TierMatch()
"""The empty match (no block held in any tier)."""


class PrefixIndex:
    """Which block hashes a replica holds, and in which tier, as far as its events have told us.

    NOTE: chained hashes make flat sets enough: hash k can only equal the prompt's
    hash k if every block before it matched too, so "leading blocks present" needs
    no tree. A block evicted mid-chain simply ends the match there, exactly as the
    replica's own lookup would.

    NOTE: one set per tier, not a dict hash -> tier: a device-only replica (the
    common case) then costs exactly what it did before tiers (the same set, bulk
    `update`/`difference_update` in C, no per-hash objects), and a lower tier costs
    only while it holds something. A hash is in at most one tier: a `stored` in one
    tier moves it out of the others, and a `removed` for a tier drops it only from
    that tier, so "device removed, then host stored" (a demotion) and "device stored
    and host removed" (a promotion) land right in either order.
    """

    __slots__ = ("_device", "_disk", "_host", "_tiers")

    def __init__(self, hashes: Iterable[BlockHash] = ()) -> None:
        self._device: set[BlockHash] = set(hashes)  # hashes held on the device
        self._host: set[BlockHash] = set()  # hashes held in host memory
        self._disk: set[BlockHash] = set()  # hashes held on local disk
        # NOTE: Tier is a StrEnum, so a plain "host" finds the same set.
        self._tiers: dict[str, set[BlockHash]] = {
            Tier.DEVICE: self._device,
            Tier.HOST: self._host,
            Tier.DISK: self._disk,
        }  # each tier's set, by tier name

    def __len__(self) -> int:
        return len(self._device) + len(self._host) + len(self._disk)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._device or block_hash in self._host or block_hash in self._disk

    @property
    def has_lower(self) -> bool:
        """True while some hash is held below the device."""
        return bool(self._host) or bool(self._disk)

    def size(self, tier: Tier) -> int:
        """How many hashes ``tier`` holds."""
        return len(self._set(tier))

    def tier_of(self, block_hash: BlockHash) -> Tier | None:
        """The tier holding ``block_hash``, or None when no tier does."""
        if block_hash in self._device:
            return Tier.DEVICE
        if block_hash in self._host:
            return Tier.HOST
        if block_hash in self._disk:
            return Tier.DISK
        return None

    def _set(self, tier: str) -> set[BlockHash]:
        try:
            return self._tiers[tier]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown tier {tier!r}; expected one of {', '.join(self._tiers)}"
            ) from None

    def apply(self, event: KVEvent) -> None:
        # NOTE: device events are the common case and carry the `Tier.DEVICE`
        # singleton: an identity test skips hashing the enum (a Python-level call).
        if isinstance(event, BlockStored):
            hashes = event.block_hashes
            tier = event.tier
            if tier is _DEVICE:
                if self._host or self._disk:  # a device-only replica skips this
                    self._host.difference_update(hashes)
                    self._disk.difference_update(hashes)
                self._device.update(hashes)
                return
            target = self._set(tier)
            for other in (self._device, self._host, self._disk):
                if other is not target and other:
                    other.difference_update(hashes)
            target.update(hashes)
        elif isinstance(event, BlockRemoved):
            tier = event.tier
            (self._device if tier is _DEVICE else self._set(tier)).difference_update(
                event.block_hashes
            )
        elif isinstance(event, AllBlocksCleared):
            self._device.clear()
            self._host.clear()
            self._disk.clear()
        else:
            raise TypeError(f"not a kv event: {event!r}")

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def replace(
        self,
        hashes: Iterable[BlockHash],
        *,
        host: Iterable[BlockHash] = (),
        disk: Iterable[BlockHash] = (),
    ) -> None:
        """Load a snapshot: the replica's full index at some (epoch, seq).

        ``hashes`` are the device's; ``host`` and ``disk`` the lower tiers'. A hash
        listed in two tiers is kept in the faster one.
        """
        device = set(hashes)
        in_host = set(host)
        in_disk = set(disk)
        if in_host:
            in_host -= device
        if in_disk:
            in_disk -= device
            in_disk -= in_host
        self._device, self._host, self._disk = device, in_host, in_disk
        self._tiers = {Tier.DEVICE: device, Tier.HOST: in_host, Tier.DISK: in_disk}

    def _device_run(self, block_hashes: Sequence[BlockHash]) -> int:
        present = self._device
        n = 0
        for h in block_hashes:
            if h not in present:
                break
            n += 1
        return n

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of ``block_hashes`` the replica would hit, in any tier.

        That is the device run plus the lower-tier run right after it, as
        `match_tiers` counts them; on a device-only replica, the device run.
        """
        n = self._device_run(block_hashes)
        if not (self._host or self._disk) or n == len(block_hashes):
            return n
        return n + self._lower_run(block_hashes, n)[0]

    def match_tiers(self, block_hashes: Sequence[BlockHash]) -> TierMatch:
        """The leading blocks the replica would hit, counted per tier (see `TierMatch`)."""
        n = self._device_run(block_hashes)
        if not (self._host or self._disk) or n == len(block_hashes):
            return TierMatch(n) if n else NO_MATCH
        _, host, disk = self._lower_run(block_hashes, n)
        return TierMatch(n, host, disk)

    def _lower_run(self, block_hashes: Sequence[BlockHash], start: int) -> tuple[int, int, int]:
        """(total, host, disk) of the run of lower-tier blocks from ``start``."""
        in_host, in_disk = self._host, self._disk
        host = disk = 0
        for i in range(start, len(block_hashes)):
            h = block_hashes[i]
            if h in in_host:
                host += 1
            elif h in in_disk:
                disk += 1
            else:
                break
        return host + disk, host, disk
