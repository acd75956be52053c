"""Restore or recompute: a cost model learned online from real timings.

recompute_s = tokens / prefill_rate
restore_s   = overhead + bytes / fetch_bw (per source tier) + bytes / restore_bw + queue_wait
readable_s  = tokens * readable_per_token  (an answer's save, until Redis holds it)
write_s     = bytes * slot_write_per_byte  (llama-server writing a slot's file: its other slots wait)

The prefill rate is also learned apart by how many other slots were computing when a prompt
began (llama-server batches them together): on one CPU thread three 515-token prompts at once ran
at a median 91 tokens/s against 172 alone. Forwarding compares nodes by it. A restore is a task
in llama-server's queue, run between decode batches: beside a slot that computes a long prompt it
waits for the batch then running (11.6 s for a 2,048-token batch of SmolLM2 on a loaded 2-core
host), and the request sent after it waits for the next batch too, where the same prompt
recomputed waits once and joins that batch. A restore's wait in the queue is learned by the same
levels and added to a restore decision at that level, whose recompute is priced at that level's rate.

The rate is learned apart by a prompt's length as well (``LENGTH_BOUNDS``), and a recompute of n
tokens is priced at the rate of prompts about as long. One rate over all prompts mixes a node's
short follow-ups with its long prompts, and they differ most where it matters: on a GPU a short
prompt is bound by fixed costs per batch (a 40-token follow-up at a tenth of a long prompt's
tokens/s), so a rate learned mostly from follow-ups would price a long recompute several times too
high and choose restores that are slower than llama-server computing the prompt itself. On a CPU
with attention-bound models, a long prompt runs slower per token than a short one.

Rates are exponentially weighted moving averages of what this node measured, starting from
priors. A restore is chosen only when it is predicted to be clearly faster (``margin``), so a
short prefix or a fast GPU prefill is recomputed.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class Ewma:
    def __init__(self, prior: float, alpha: float = 0.3):
        self.value = prior
        self.alpha = alpha
        self.samples = 0

    def update(self, sample: float) -> None:
        if sample <= 0:
            return
        # The first real sample replaces the prior outright: priors are guesses, samples are facts.
        self.value = sample if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * sample
        self.samples += 1


@dataclass(frozen=True, slots=True)
class Decision:
    restore: bool
    tokens: int
    predicted_restore_s: float
    predicted_recompute_s: float
    reason: str


class CostModel:
    """Args: prefill_tps: prior tokens/s; restore_gbps: prior end-to-end restore GB/s."""

    FIXED_OVERHEAD_S = 0.010  # file write + HTTP round trip of a restore, measured ~5-10 ms here
    # llama-server's write of a slot file before it has written one here: 0.25 GB/s, below what it
    # has done on any node so far (0.35-4 GB/s on 2-core VMs, tmpfs). Too slow a guess only holds
    # the first save back a little longer (``aftercare.save_pause``); the first write replaces it.
    # Too fast a one lets it go into the next request: at 1 GB/s a fresh node's first 8B save
    # (125 MB, written at 0.35 GB/s) waited 62 ms, and a new conversation 0.1 s later waited for it.
    SLOT_WRITE_PRIOR_BPS = 0.25e9
    SHARING_LEVELS = 4  # prefill rates learned apart beside 0, 1, 2, and 3 or more computing slots
    # ...and by length: prompts of 32-127, 128-511, 512-2,047 and 2,048 or more tokens computed.
    LENGTH_BOUNDS = (128, 512, 2048)
    LENGTH_LABELS = ("32-127", "128-511", "512-2047", "2048+")  # the metric's names for them
    # A learned queue wait halves every this many seconds without a new sample: a wait priced in
    # stops restores at its level, and so its own samples, and a long one (a batch of a long prompt)
    # must not stop them for good; the next restore at that level measures it again.
    QUEUE_WAIT_HALF_LIFE_S = 120.0

    def __init__(self, prefill_tps: float = 300.0, restore_gbps: float = 0.5, margin: float = 0.8,
                 min_tokens: int = 0, clock: Callable[[], float] = time.monotonic):
        self.prefill_tps = Ewma(prefill_tps)
        self.prefill_shared = [Ewma(0.0) for _ in range(self.SHARING_LEVELS)]  # no prior: measured only
        # By length, one row per level and a last one over all levels; measured only.
        self.prefill_by_length = [[Ewma(0.0) for _ in range(len(self.LENGTH_BOUNDS) + 1)]
                                  for _ in range(self.SHARING_LEVELS + 1)]
        self.fetch_bps: dict[str, Ewma] = {}
        self.restore_bps = Ewma(restore_gbps * 1e9)
        self.readable_s_per_token = Ewma(0.0)  # no prior: unknown until this node's first save lands
        self.slot_write_s_per_byte = Ewma(1 / self.SLOT_WRITE_PRIOR_BPS)
        self.queue_wait_s = [Ewma(0.0) for _ in range(self.SHARING_LEVELS)]  # a restore's wait, by level
        self._queue_wait_at = [0.0] * self.SHARING_LEVELS  # when each level's wait was last measured
        self._clock = clock
        self._fetch_prior = restore_gbps * 1e9
        self.margin = margin
        self.min_tokens = min_tokens
        self._lock = threading.Lock()

    def observe_prefill(self, tokens: int, ms: float, sharing: int = 0) -> None:
        """A prompt of ``tokens`` computed in ``ms``, begun beside ``sharing`` other computing slots."""
        # Tiny prefills are dominated by fixed costs and would teach a wrong rate.
        if tokens >= 32 and ms > 0:
            rate, level, length = tokens / (ms / 1000), min(max(sharing, 0), self.SHARING_LEVELS - 1), \
                self._length(tokens)
            with self._lock:
                self.prefill_tps.update(rate)
                self.prefill_shared[level].update(rate)
                self.prefill_by_length[level][length].update(rate)
                self.prefill_by_length[-1][length].update(rate)

    def prefill_rate(self, sharing: int | None, tokens: int | None = None) -> float:
        """Tokens/s of a prompt begun beside ``sharing`` computing slots: as measured at that level,
        else at the nearest level below it measured, else the rate over all prompts (``None``: over
        all levels). With ``tokens``, the rate of that level's prompts nearest that long measured
        (the longer of two as near)."""
        with self._lock:
            level = None if sharing is None else self._level(self.prefill_shared, sharing)
            if level is None and sharing is not None:
                return self.prefill_tps.value  # nothing measured at any level
            overall = self.prefill_tps if level is None else self.prefill_shared[level]
            if tokens is None:
                return overall.value
            row = self.prefill_by_length[-1 if level is None else level]
            return self._nearest_length(row, self._length(tokens), overall).value

    @classmethod
    def _length(cls, tokens: int) -> int:
        """The length bucket of a prompt of ``tokens`` computed (an index into ``LENGTH_LABELS``)."""
        return bisect.bisect_right(cls.LENGTH_BOUNDS, tokens)

    @staticmethod
    def _nearest_length(row: list[Ewma], length: int, otherwise: Ewma) -> Ewma:
        measured = [i for i, rate in enumerate(row) if rate.samples]
        if not measured:
            return otherwise
        return row[min(measured, key=lambda i: (abs(i - length), -i))]

    def recompute_s(self, tokens: int, sharing: int | None = None) -> float:
        """Seconds to compute ``tokens`` prompt tokens begun beside ``sharing`` computing slots."""
        return tokens / self.prefill_rate(sharing, tokens) if tokens > 0 else 0.0

    def observe_queue_wait(self, sharing: int, seconds: float) -> None:
        """A restore waited ``seconds`` in llama-server's queue, sent beside ``sharing`` computing slots."""
        level = min(max(sharing, 0), self.SHARING_LEVELS - 1)
        with self._lock:  # a wait of 0 is a sample too (an Ewma takes positive ones)
            self.queue_wait_s[level].value = self._queue_wait_now(level)
            self.queue_wait_s[level].update(max(seconds, 1e-6))
            self._queue_wait_at[level] = self._clock()

    def queue_wait(self, sharing: int) -> float:
        """Seconds a restore sent beside ``sharing`` computing slots is expected to wait in
        llama-server's queue: as measured at that level, else the nearest measured below, fading
        with time (``QUEUE_WAIT_HALF_LIFE_S``); 0 alone."""
        if sharing <= 0:
            return 0.0
        with self._lock:
            level = self._level(self.queue_wait_s, sharing)
            return 0.0 if level is None else self._queue_wait_now(level)

    def _queue_wait_now(self, level: int) -> float:
        age = max(0.0, self._clock() - self._queue_wait_at[level])
        return float(self.queue_wait_s[level].value * 0.5 ** (age / self.QUEUE_WAIT_HALF_LIFE_S))

    def _level(self, levels: list[Ewma], sharing: int) -> int | None:
        """``sharing``'s level when measured, else the nearest measured below; None: none."""
        for level in range(min(max(sharing, 0), self.SHARING_LEVELS - 1), -1, -1):
            if levels[level].samples:
                return level
        return None

    def observe_fetch(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20 and seconds > 0:
            with self._lock:
                self.fetch_bps.setdefault(tier, Ewma(self._fetch_prior)).update(nbytes / seconds)

    def observe_restore(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20 and seconds > 0:
            with self._lock:
                self.restore_bps.update(nbytes / seconds)

    def observe_readable(self, tokens: int, seconds: float) -> None:
        """An answer of ``tokens`` prompt tokens whose save Redis held ``seconds`` after it ended."""
        if tokens > 0:
            with self._lock:
                self.readable_s_per_token.update(seconds / tokens)

    def expected_readable(self, tokens: int) -> float | None:
        """Seconds from an answer of ``tokens`` prompt tokens until Redis holds its save; None
        before this node has seen one (nodes alike save alike: its figure stands for its peers')."""
        with self._lock:
            per_token = self.readable_s_per_token
            return per_token.value * tokens if per_token.samples else None

    def observe_slot_write(self, nbytes: int, seconds: float) -> None:
        """llama-server wrote a slot's file of ``nbytes`` in ``seconds`` (its own ``save_ms``)."""
        if nbytes >= 1 << 20 and seconds > 0:  # a small file's time is fixed costs
            with self._lock:
                self.slot_write_s_per_byte.update(seconds / nbytes)

    def expected_slot_write(self, nbytes: int) -> float:
        """Seconds llama-server should take to write a slot's file of ``nbytes`` (at
        ``SLOT_WRITE_PRIOR_BPS`` before it has written one of 1 MiB or more)."""
        with self._lock:
            return self.slot_write_s_per_byte.value * nbytes

    def could_restore(self, gain: int, n_tokens: int, bytes_per_token: int) -> bool:
        """Whether any lookup could lead to a restore when it brings at most ``gain`` tokens more
        than the slot holds and the restore loads ``n_tokens`` (every byte from the fastest tier
        measured): False spares the lookup. Restoring loads the whole prefix, not the gain, so a
        slot that holds all but a few new tokens of a long prompt never gains from one; with a
        smaller gain the restore is cheaper but the recompute more so (both are linear)."""
        if gain <= 0 or gain < self.min_tokens:
            return False
        # The slowest rate a decision on any gain up to this one would price its recompute at.
        lengths = (min(gain, 32), *(bound for bound in self.LENGTH_BOUNDS if bound <= gain))
        rate = min(self.prefill_rate(None, length) for length in lengths)
        with self._lock:
            fastest = max([self._fetch_prior, *(e.value for e in self.fetch_bps.values())])
            nbytes = n_tokens * bytes_per_token
            restore = self.FIXED_OVERHEAD_S + nbytes / fastest + nbytes / self.restore_bps.value
            return restore < gain / rate * self.margin

    def decide(self, tokens: int, bytes_by_tier: dict[str, int], sharing: int | None = None) -> Decision:
        """Should ``tokens`` be restored (reading ``bytes_by_tier``) instead of recomputed? With
        ``sharing`` (other slots computing), the restore's queue wait and the prefill rate at that
        level count; without it, the rates over all prompts and no wait."""
        recompute = self.recompute_s(tokens, sharing)
        wait = 0.0 if sharing is None else self.queue_wait(sharing)
        with self._lock:
            total = sum(bytes_by_tier.values())
            fetch = sum(n / self.fetch_bps.get(t, Ewma(self._fetch_prior)).value for t, n in bytes_by_tier.items())
            restore = self.FIXED_OVERHEAD_S + fetch + total / self.restore_bps.value + wait
        if tokens <= 0:
            return Decision(False, 0, restore, recompute, "nothing to restore")
        if tokens < self.min_tokens:
            return Decision(False, tokens, restore, recompute, "below restore_min_tokens")
        if restore < recompute * self.margin:
            return Decision(True, tokens, restore, recompute, "restore is faster")
        return Decision(False, tokens, restore, recompute, "recompute is faster")
