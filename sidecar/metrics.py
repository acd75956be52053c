"""Prometheus metrics of one sidecar (own registry, so several apps can live in one process)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tiers.pace import Pace
from tiers.store import TieredStore

from .costmodel import CostModel
from .heap import heap_usage

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
FAST_BUCKETS = (0.0002, 0.0005, 0.001, 0.002) + LATENCY_BUCKETS  # sub-millisecond steps
LOOP_LAG_INTERVAL_S = 0.1  # how often the event loop's lateness is sampled (``watch_loop_lag``)


class _HeapCollector:
    """The malloc heap at scrape time (``heap.heap_usage``): why RSS stays above what the tiers
    hold (freed chunk buffers kept for reuse, and holes no new chunk fits). Nothing off glibc."""

    def collect(self):  # type: ignore[no-untyped-def]
        usage = heap_usage()
        if usage is None:
            return
        heap = GaugeMetricFamily("kvtier_heap_bytes", "The sidecar's malloc heap: in use, free (kept for reuse; "
                                 "between blocks in use, their pages given back after saves), and free at its top", labels=["state"])
        heap.add_metric(["in_use"], usage.in_use)
        heap.add_metric(["free"], usage.free)
        heap.add_metric(["free_at_top"], usage.free_at_top)
        yield heap


class _PaceCollector:
    """How long the save's work rested to keep to ``--save-cpu-share`` (``tiers.pace``)."""

    def __init__(self, pace: Pace):
        self.pace = pace

    def collect(self):  # type: ignore[no-untyped-def]
        yield CounterMetricFamily("kvtier_save_paced_seconds", "Seconds a save's work waited to keep to "
                                  "--save-cpu-share of a core while slots computed on a contended host",
                                  value=self.pace.rested_s)


class _TierCollector:
    """Per-tier counters read from the store at scrape time (no double bookkeeping)."""

    def __init__(self, store: TieredStore):
        self.store = store

    def collect(self):  # type: ignore[no-untyped-def]
        stats = self.store.stats()
        hits = CounterMetricFamily("kvtier_tier_hits", "Chunks found per tier", labels=["tier"])
        misses = CounterMetricFamily("kvtier_tier_misses", "Chunks not found per tier", labels=["tier"])
        evictions = CounterMetricFamily("kvtier_tier_evictions", "Chunks evicted per tier", labels=["tier"])
        errors = CounterMetricFamily("kvtier_tier_errors", "Failed tier operations", labels=["tier"])
        bytes_in = CounterMetricFamily("kvtier_tier_bytes_written", "Bytes written per tier", labels=["tier"])
        bytes_out = CounterMetricFamily("kvtier_tier_bytes_read", "Bytes read per tier", labels=["tier"])
        used = GaugeMetricFamily("kvtier_tier_bytes_used", "Bytes held per tier", labels=["tier"])
        entries = GaugeMetricFamily("kvtier_tier_entries", "Entries held per tier", labels=["tier"])
        up = GaugeMetricFamily("kvtier_tier_available", "1 when the tier is usable (circuit closed)", labels=["tier"])
        for name, st in stats.items():
            hits.add_metric([name], st.hits)
            misses.add_metric([name], st.misses)
            evictions.add_metric([name], st.evictions)
            errors.add_metric([name], st.errors)
            bytes_in.add_metric([name], st.bytes_in)
            bytes_out.add_metric([name], st.bytes_out)
            used.add_metric([name], st.bytes_used)
            entries.add_metric([name], st.entries)
            up.add_metric([name], 1 if st.available else 0)
        yield from (hits, misses, evictions, errors, bytes_in, bytes_out, used, entries, up)
        c = self.store.counters
        yield CounterMetricFamily("kvtier_corrupt_chunks", "Damaged or foreign chunks found and deleted", value=c.corrupt)
        yield CounterMetricFamily("kvtier_dropped_writes", "Background writes dropped (queue full)", value=c.dropped_writes)
        yield CounterMetricFamily("kvtier_background_write_errors", "Failed background writes", value=c.background_errors)
        yield GaugeMetricFamily("kvtier_write_queue_depth", "Pending background writes", value=self.store.queue_depth)


class _PrefillCollector:
    """The prefill rates the cost model learned, read from it at scrape time."""

    def __init__(self, cost: CostModel):
        self.cost = cost

    def collect(self):  # type: ignore[no-untyped-def]
        rates = GaugeMetricFamily("kvtier_prefill_tokens_per_second", "The prefill rate the cost model learned for "
                                  "prompts begun beside `beside` other computing slots (3: 3 or more)",
                                  labels=["beside"])
        for level, rate in enumerate(self.cost.prefill_shared):
            if rate.samples:
                rates.add_metric([str(level)], rate.value)
        yield rates
        by_length = GaugeMetricFamily("kvtier_prefill_length_tokens_per_second", "The prefill rate the cost model "
                                      "learned for prompts of `tokens` tokens computed, beside any number of slots "
                                      "(a recompute is priced at the rate of prompts about as long)",
                                      labels=["tokens"])
        for label, rate in zip(self.cost.LENGTH_LABELS, self.cost.prefill_by_length[-1], strict=True):
            if rate.samples:
                by_length.add_metric([label], rate.value)
        yield by_length


class _QueueCollector:
    """Requests waiting for a slot, counted in the slot table at scrape time: a gauge set when a
    request joined the queue kept its peak after waiters that gave up had left it."""

    def __init__(self) -> None:
        self.depth: Callable[[], int] = lambda: 0  # until the app knows its engine

    def collect(self):  # type: ignore[no-untyped-def]
        yield GaugeMetricFamily("kvtier_slot_queue_depth", "Requests waiting for a slot", value=self.depth())


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._restore_metrics(r)
        self._save_metrics(r)
        self.requests = Counter("kvtier_requests", "Completion requests by path and outcome", ["path", "outcome"], registry=r)
        self.tokens_restored = Counter("kvtier_tokens_restored", "Prompt tokens restored from the tiers", registry=r)
        self.tokens_recomputed = Counter("kvtier_tokens_recomputed", "Prompt tokens llama-server computed (prompt_n)", registry=r)
        self.tails = Counter("kvtier_tails", "Partial tails (a saved slot's cells after its last full chunk): "
                             "stored, restored, deleted (superseded by a longer state)", ["event"], registry=r)
        self.follow_ups = Counter("kvtier_follow_ups", "Requests sent to the slot holding what they continue, "
                                  "without tokenizing them (nothing to restore)", registry=r)
        self.tokens_slot_reused = Counter("kvtier_tokens_slot_reused", "Prompt tokens already in the chosen slot", registry=r)
        self.saves_skipped = Counter("kvtier_saves_skipped", "Saves after an answer not made: a request already "
                                     "waited for the slot, and its own save stores it all, or all but an end "
                                     "no tier holds and cheaper to recompute than the wait for the save", registry=r)
        self.saves_skipped_ends = Counter("kvtier_saves_skipped_ends", "Of the saves skipped, those that left an "
                                          "end (no tier holds it) to recompute when the skipped prompt returns: "
                                          "another last question, or another conversation, waited", registry=r)
        self.saves_handed_over = Counter("kvtier_saves_handed_over", "Slots given to a waiting request while their "
                                         "save waited in llama-server's queue (which runs the save first)",
                                         registry=r)
        self.decisions = Counter("kvtier_cost_decisions", "Cost-model decisions: restore, recompute, spared (no "
                                 "lookup: no prefix the tiers could hold would be restored), or llama_cache (left "
                                 "to llama-server's own prompt cache, which loads it without queueing)", ["decision"], registry=r)
        self.prompt_end_saves = Counter("kvtier_prompt_end_saves", "States saved at a prompt's end, before its "
                                        "answer (--save-prompt-end): stored, or failed (the request goes on)",
                                        ["outcome"], registry=r)
        self.cache_errors = Counter("kvtier_cache_errors", "Cache failures that fell back to recompute", ["stage"], registry=r)
        self.save_waits = Counter("kvtier_save_waits", "Requests that waited for another save in flight: landed "
                                  "(it brought more), failed (gone, nothing more), timeout; skipped: not "
                                  "waited for, expected later than waiting would pay", ["outcome"], registry=r)
        self.save_wait_seconds = Histogram("kvtier_save_wait_seconds", "Time waited for a save in flight",
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.server_checks_seconds = Histogram("kvtier_server_checks_seconds", "Checks of llama-server's identity "
                                               "a request waited for (not confirmed)", buckets=LATENCY_BUCKETS, registry=r)
        self.overhead_seconds = Histogram("kvtier_overhead_seconds", "Sidecar time before forwarding (prompt tokens, "
                                          "slot choice, restore)", buckets=FAST_BUCKETS, registry=r)
        self.prompt_seconds = Histogram(
            "kvtier_prompt_seconds", "Time to learn a request's prompt tokens: ids (given), in_process, "
            "llama_server (at least one round trip)", ["way"], buckets=FAST_BUCKETS, registry=r)
        self.prompt_mismatches = Counter(
            "kvtier_prompt_mismatches", "In-process prompt steps turned off because llama-server disagreed",
            ["step"], registry=r)
        self.prompt_in_process = Gauge("kvtier_prompt_in_process", "1 while the step (render, tokenize) runs in "
                                       "kvtier, 0 while llama-server is asked", ["step"], registry=r)
        self.bytes_saved = Counter("kvtier_bytes_saved", "New chunk bytes stored", registry=r)
        self._queue = _QueueCollector()
        r.register(self._queue)
        r.register(_HeapCollector())
        self.pending_saves = Gauge("kvtier_pending_saves", "Slot saves not finished yet", registry=r)
        self.prewarmed = Counter("kvtier_prewarmed_chunks", "Chunks copied into local tiers from peers' events", registry=r)
        self.redis_circuit = Gauge("kvtier_redis_circuit_open", "1 while the Redis circuit breaker is open", registry=r)
        self.loop_lag_seconds = Histogram(
            "kvtier_event_loop_lag_seconds", "How late the event loop woke for a timer (sampled every 0.1 s): "
            "every request it relays waits as long (a save thread's GIL, CPU taken by others)",
            buckets=FAST_BUCKETS, registry=r)

    def _save_metrics(self, r: CollectorRegistry) -> None:
        """How long saves took, waited and took to reach Redis."""
        self.save_seconds = Histogram("kvtier_save_seconds", "Slot save + split + store", buckets=LATENCY_BUCKETS, registry=r)
        self.save_deferred_seconds = Histogram("kvtier_save_deferred_seconds", "Time a save waited after its answer "
                                               "while other slots computed (--save-defer)", buckets=LATENCY_BUCKETS,
                                               registry=r)
        self.save_readable_seconds = Histogram(
            "kvtier_save_readable_seconds", "From the end of an answer until Redis holds its new chunks and tail "
            "(when another node's next turn can restore it)", buckets=LATENCY_BUCKETS, registry=r)

    def _restore_metrics(self, r: CollectorRegistry) -> None:
        """What restores did, how long they took and what came of them."""
        self.restores = Counter("kvtier_restores", "Restores by source tier and outcome", ["tier", "outcome"], registry=r)
        self.restores_wasted = Counter("kvtier_restores_wasted", "Restores llama-server threw away (it recomputed "
                                       "what was restored), by memory layout", ["layout"], registry=r)
        self.reuse_failures = Counter("kvtier_restore_not_reused", "Restores after which prompt_n showed a re-prefill", registry=r)
        self.restore_seconds = Histogram("kvtier_restore_seconds", "Fetch + assemble + restore", buckets=LATENCY_BUCKETS, registry=r)
        self.restore_streams = Counter("kvtier_restore_streams", "Large plain-KV restores whose file was written as "
                                       "its chunks arrived: written, or stopped (a chunk gone or unlike the first: "
                                       "restored from what the tiers hold instead)", ["outcome"], registry=r)
        self.restore_phase_seconds = Histogram(
            "kvtier_restore_phase_seconds", "Restore time by phase: fetch (tiers), assemble, write (state file), "
            "queue (waiting in llama-server's queue behind other slots' batches), llama (llama-server's restore)", ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.bytes_restored = Counter("kvtier_bytes_restored", "State bytes restored into llama-server", registry=r)

    def attach_store(self, store: TieredStore) -> None:
        self.registry.register(_TierCollector(store))

    def attach_queue(self, depth: Callable[[], int]) -> None:
        """Where ``kvtier_slot_queue_depth`` is read from: a function giving the waiting requests."""
        self._queue.depth = depth

    def attach_pace(self, pace: Pace) -> None:
        self.registry.register(_PaceCollector(pace))

    def attach_cost(self, cost: CostModel) -> None:
        self.registry.register(_PrefillCollector(cost))

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def watch_loop_lag(histogram: Histogram, interval: float = LOOP_LAG_INTERVAL_S) -> None:
    """Observe into ``histogram``, every ``interval`` seconds, how much later than asked the event
    loop woke (0 when on time): a stall of the loop stops every relayed token, and nothing else
    shows it. Runs until cancelled."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(interval)
        histogram.observe(max(0.0, time.perf_counter() - t0 - interval))
