"""What llama-server's own host-memory prompt cache (``--cache-ram``) holds, kept by its rules.

llama-server alone keeps prompts twice: in its slots, and in a prompt cache in RAM. When a
completion is about to overwrite most of a slot (it keeps under half of the slot's tokens), the
slot's prompt is copied into that cache and the entry that serves the new prompt best is loaded
into the slot instead, in the same task: no wait in llama-server's queue, a memory copy. After each
task it starts, it also copies every idle slot's prompt there (``--cache-idle-slots``, on by
default). kvtier's own restore is a slot action queued behind the batches other slots compute, so
a prompt llama-server would load by itself is left to it: ``LlamaPromptCache.reused`` tells what
llama-server would reuse of a prompt without kvtier, and the planner restores only more than that.

The rules mirrored (``server_prompt_cache`` and ``get_available_slot`` in llama.cpp's server):

- a completion sent to a slot holding ``held`` updates the cache when ``held`` is not empty and the
  new prompt keeps under ``KEEP_TO_SAVE`` of it (a common prefix under ``SIMILARITY`` of the new
  prompt counts as none);
- an update saves ``held`` (unless an entry already starts with all of it; entries that ``held``
  contains go; the oldest go while the size limit is exceeded), then loads the entry that keeps at
  least ``KEEP_TO_LOAD`` of itself and beats the slot both on the share of itself kept and on the
  share of the new prompt covered; a loaded entry leaves the cache;
- idle slots are saved the same way after each task starts.

The mirror knows only what went through kvtier, so it can be wrong (a request sent to llama-server
directly, a llama-server flag kvtier was not told of). llama-server's answer tells: when it reused
less than the mirror promised ``MISSES_LIMIT`` times in a row, the mirror is off for that
llama-server process and kvtier restores as if llama-server kept nothing itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from integrations.llama_server import LlamaServerClient, LlamaServerError, Timings, prefix_reused
from tiers.keys import common_prefix

from .slots import SlotTable

log = logging.getLogger("kvtier.engine")

SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity default
KEEP_TO_SAVE = 0.5  # a slot's prompt is cached when a completion keeps less of it than this share
KEEP_TO_LOAD = 0.25  # an entry is loaded only when the prompt keeps at least this share of it
DEFAULT_MIB = 8192  # llama-server's --cache-ram default
MISSES_LIMIT = 2  # answers in a row that reused less than the mirror said, before it turns off

# Two short prompts with nothing in common (``detect``).
_PROBE_KEPT = "kvtier checks whether this llama-server keeps prompts in its own host-memory cache: " * 2
_PROBE_OTHER = "Zebras, quartz and violins share nothing with the words before."


@dataclass(slots=True, eq=False)  # entries are told apart by identity (their tokens are arrays)
class _Entry:
    tokens: np.ndarray
    owner: str  # the tenant whose prompt it is: another tenant's entry never counts as reused
    nbytes: int


class LlamaPromptCache:
    """A mirror of one llama-server process's prompt cache (``--cache-ram``).

    Args:
        limit_mib: llama-server's ``--cache-ram`` (-1: no size limit; 0: no cache, the mirror is off).
        bytes_per_token: KV bytes of one token (what an entry costs against the limit).
        max_tokens: without a size limit, llama-server keeps at most its context's tokens (``-c``).
    """

    def __init__(self, limit_mib: int, bytes_per_token: int, max_tokens: int = 0):
        self.on = limit_mib != 0
        self.limit = max(limit_mib, 0) << 20  # 0: no size limit (when on)
        self.max_tokens = max_tokens if not self.limit else 0  # 0: none
        self.bytes_per_token = max(bytes_per_token, 1)
        self.entries: list[_Entry] = []  # oldest first
        self._saved: dict[int, np.ndarray] = {}  # slot -> the token array last saved from it
        self._misses = 0

    def reused(self, held: np.ndarray, tokens: np.ndarray, base: int, owner: str) -> int:
        """Tokens of ``tokens`` llama-server would reuse by itself in a slot holding ``held`` (of
        tenant ``owner``) that shares ``base`` tokens with them: those, or the cached entry it would load."""
        if not self.on or not _updates(held, tokens, base):
            return base
        best = self._best(held, tokens, base)
        if best is None or best.owner != owner:
            return base
        return common_prefix(best.tokens, tokens)

    def keeps(self, held: int, kept: int) -> bool:
        """Whether a completion that keeps ``kept`` of a slot holding ``held`` tokens has llama-server
        copy the slot's prompt into its cache first (it fits there)."""
        return (self.on and held > 0 and kept / held < KEEP_TO_SAVE
                and (not self.limit or held * self.bytes_per_token <= self.limit))

    def launched(self, table: SlotTable, slot: int, tokens: np.ndarray | None) -> None:
        """A completion of ``tokens`` goes to ``slot`` now (None: a follow-up, which keeps what the
        slot holds): update the mirror as llama-server updates its cache."""
        if not self.on:
            return
        record = table.slots[slot]
        held, owner = record.hot()
        base = common_prefix(held, tokens) if tokens is not None else 0
        if tokens is not None and _updates(held, tokens, base):
            self._save(slot, held, owner)
            best = self._best(held, tokens, base)
            if best is not None:
                self.entries.remove(best)
        for other in table.slots:
            if other.id != slot and (not other.busy or other.saving):
                self._save(other.id, *other.hot())

    def answered(self, promised: int, timings: Timings | None, prompt_tokens: int) -> None:
        """An answer the mirror promised ``promised`` reused tokens for (more than the slot held):
        count it a miss when llama-server reused less; off after ``MISSES_LIMIT`` in a row."""
        if not self.on or timings is None:
            return
        if prefix_reused(timings, prompt_tokens, promised):
            self._misses = 0
            return
        self._misses += 1
        if self._misses >= MISSES_LIMIT:
            self.on = False
            log.warning("llama-server's own prompt cache did not serve %d prompts in a row as kvtier expected "
                        "(last: %d of %d tokens reused, %d expected): kvtier restores them itself from now on "
                        "(set --llama-cache-ram to llama-server's --cache-ram)", self._misses, timings.cache_n,
                        prompt_tokens, promised)

    def _best(self, held: np.ndarray, tokens: np.ndarray, base: int) -> _Entry | None:
        """The entry llama-server would load into a slot holding ``held`` for ``tokens``."""
        keep_best = base / held.size if held.size else -1.0
        sim_best = base / max(tokens.size, 1)
        best = None
        for entry in self.entries:
            lcp = common_prefix(entry.tokens, tokens)
            keep, sim = lcp / entry.tokens.size, lcp / max(tokens.size, 1)
            if keep >= KEEP_TO_LOAD and keep > keep_best and sim > sim_best:
                best, keep_best, sim_best = entry, keep, sim
        return best

    def _save(self, slot: int, tokens: np.ndarray, owner: str) -> None:
        if tokens.size == 0 or self._saved.get(slot) is tokens:
            return  # saved before, unchanged since (llama-server skips a prompt it holds already)
        self._saved[slot] = tokens
        if any(common_prefix(e.tokens, tokens) == tokens.size for e in self.entries):
            return
        nbytes = int(tokens.size) * self.bytes_per_token
        if self.limit and nbytes > self.limit:
            return
        self.entries = [e for e in self.entries if common_prefix(e.tokens, tokens) < e.tokens.size]
        total = sum(e.nbytes for e in self.entries)
        while self.entries and self.limit and total + nbytes > self.limit:
            total -= self.entries.pop(0).nbytes
        self.entries.append(_Entry(tokens, owner, nbytes))
        count = sum(int(e.tokens.size) for e in self.entries)
        while len(self.entries) > 1 and self.max_tokens and count > self.max_tokens:
            count -= int(self.entries.pop(0).tokens.size)


def _updates(held: np.ndarray, tokens: np.ndarray, lcp: int) -> bool:
    """Whether a completion of ``tokens`` into a slot holding ``held`` (sharing ``lcp``) updates
    llama-server's prompt cache: the slot is not empty and would keep under ``KEEP_TO_SAVE`` of it."""
    if held.size == 0:
        return False  # llama-server's keep share of an empty slot is 0/0, which never compares below
    kept = lcp if tokens.size and lcp / tokens.size > SIMILARITY else 0
    return kept / held.size < KEEP_TO_SAVE


async def detect(client: LlamaServerClient, slot: int) -> bool:
    """Whether llama-server keeps prompts in its own cache: ``slot`` (idle, its content given up)
    answers one prompt, then another with nothing in common, then the first again; only a prompt
    cache gives the third its first prompt back. The slot is erased after."""
    async def once(prompt: str) -> dict[str, Any]:
        return await client.completion({"prompt": prompt, "n_predict": 1, "id_slot": slot, "cache_prompt": True,
                                         "temperature": 0})
    try:
        await once(_PROBE_KEPT)
        await once(_PROBE_OTHER)
        timings = Timings.from_json((await once(_PROBE_KEPT)).get("timings"))
    finally:
        await client.erase_slot(slot)
    if timings is None:
        raise LlamaServerError("llama-server's answer carries no timings")
    return timings.cache_n * 2 > timings.cache_n + timings.prompt_n
