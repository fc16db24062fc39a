"""Prometheus metrics of one replica, in a registry of its own (one per app)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cachepoint.kvcore import CacheStats
from cachepoint.replica.interface import ReplicaCore
from cachepoint.replica.sequence import SequenceState

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _PoolCollector(Collector):
    """Reads kvcore's counters at scrape time, so they are exact, never sampled."""

    def __init__(self, scheduler: ReplicaCore) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.scheduler
        st = s.cache_stats()
        labels = ["replica"]
        value = [s.name]
        queries = CounterMetricFamily(
            "cachepoint_prefix_cache_query_tokens", "Prompt tokens looked up", labels=labels
        )
        queries.add_metric(value, st.query_tokens)
        hits = CounterMetricFamily(
            "cachepoint_prefix_cache_hit_tokens",
            "Prompt tokens served from cached KV",
            labels=labels,
        )
        hits.add_metric(value, st.hit_tokens)
        evictions = CounterMetricFamily(
            "cachepoint_kv_evicted_blocks", "Cached blocks evicted by LRU pressure", labels=labels
        )
        evictions.add_metric(value, st.evictions)
        refusals = CounterMetricFamily(
            "cachepoint_retention_refusals", "Retains refused by the share cap", labels=labels
        )
        refusals.add_metric(value, st.retain_refusals)
        quota = CounterMetricFamily(
            "cachepoint_retention_quota_refusals",
            "Retains refused by a tenant's retention quota (part of the refusals)",
            labels=labels,
        )
        quota.add_metric(value, st.quota_refusals)
        # NOTE: a count, never per-tenant series: replica /metrics are open to scrapers
        # and must not name orgs.
        owners = GaugeMetricFamily(
            "cachepoint_retention_owners", "Tenants holding retained blocks", labels=labels
        )
        owners.add_metric(value, st.blocks.retained_owners)
        blocks = GaugeMetricFamily(
            "cachepoint_kv_blocks", "KV blocks by state", labels=["replica", "state"]
        )
        b = st.blocks
        for state, n in (
            ("active", b.active),
            ("cached_free", b.cached_free),
            ("empty", b.empty),
            ("retained", b.retained),
        ):
            blocks.add_metric([s.name, state], n)
        entries = GaugeMetricFamily(
            "cachepoint_cache_entries", "Live managed entries", labels=labels
        )
        entries.add_metric(value, st.entries)
        queue = GaugeMetricFamily(
            "cachepoint_requests", "Requests by scheduler state", labels=["replica", "state"]
        )
        queue.add_metric([s.name, "waiting"], len(s.waiting))
        queue.add_metric([s.name, "running"], len(s.running))
        preemptions = CounterMetricFamily(
            "cachepoint_replica_preemptions",
            "Running sequences whose blocks were taken back to recompute later (KV full)",
            labels=labels,
        )
        preemptions.add_metric(value, s.preemptions)
        epoch = GaugeMetricFamily(
            "cachepoint_replica_epoch", "Epoch of this process", labels=labels
        )
        epoch.add_metric(value, s.epoch)
        yield from self._tiers(s, st)
        yield from (
            queries,
            hits,
            evictions,
            refusals,
            quota,
            owners,
            blocks,
            entries,
            queue,
            preemptions,
            epoch,
        )

    @staticmethod
    def _tiers(s: ReplicaCore, st: CacheStats) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Per tier behind the device: occupancy, and blocks and bytes moved."""
        tier_labels = ["replica", "tier"]
        held = GaugeMetricFamily(
            "cachepoint_kv_tier_blocks",
            "Blocks held per lower KV tier, by state",
            labels=[*tier_labels, "state"],
        )
        counters = {
            name: CounterMetricFamily(f"cachepoint_kv_tier_{name}", doc, labels=tier_labels)
            for name, doc in (
                ("hit_blocks", "Blocks a prefix hit in this tier (promotions started)"),
                ("promoted_blocks", "Blocks moved up from this tier into the device index"),
                ("demoted_blocks", "Blocks whose copy into this tier completed"),
                ("evicted_blocks", "Blocks pushed out of this tier (down a tier or dropped)"),
                ("promoted_bytes", "Bytes moved up from this tier into the device"),
                ("demoted_bytes", "Bytes copied into this tier"),
            )
        }
        block = s.block_bytes
        for t in st.tiers:
            key = [s.name, str(t.tier)]
            held.add_metric([*key, "visible"], t.visible)
            held.add_metric([*key, "in_flight_or_doomed"], t.used - t.visible)
            held.add_metric([*key, "retained"], t.retained)
            held.add_metric([*key, "capacity"], t.slots)
            counters["hit_blocks"].add_metric(key, t.hits)
            counters["promoted_blocks"].add_metric(key, t.promotions)
            counters["demoted_blocks"].add_metric(key, t.demotions)
            counters["evicted_blocks"].add_metric(key, t.evictions)
            counters["promoted_bytes"].add_metric(key, t.promotions * block)
            counters["demoted_bytes"].add_metric(key, t.demotions * block)
        yield held
        yield from counters.values()


class ReplicaMetrics:
    """Histograms and counters observed as requests finish."""

    def __init__(self, scheduler: ReplicaCore) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(scheduler))
        self.requests = Counter(
            "cachepoint_replica_requests",
            "Finished requests by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "cachepoint_ttft_seconds",
            "Submit to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill = Histogram(
            "cachepoint_prefill_seconds",
            "Admission to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decode = Histogram(
            "cachepoint_decode_seconds",
            "First token to finish",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decode_mixed = Histogram(
            "cachepoint_decode_mixed_seconds",
            "Of a request's decode, time in steps that also ran a prefill chunk",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.computed = Counter(
            "cachepoint_prefill_computed_tokens",
            "Prompt tokens that went through the model",
            registry=self.registry,
        )

    def observe(self, seq: SequenceState) -> None:
        if seq.stop_reason is None:
            outcome = "cancelled" if seq.cancelled else "error"
            self.requests.labels(outcome).inc()
            return
        self.requests.labels("ok").inc()
        self.ttft.observe(seq.t_first - seq.t_submit)
        self.prefill.observe(seq.t_first - seq.t_admit)
        self.decode.observe(seq.t_end - seq.t_first)
        self.decode_mixed.observe(seq.decode_mixed_s)
        if seq.cache is not None:
            self.computed.inc(seq.cache.computed_tokens)
