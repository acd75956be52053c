"""The mirror of llama-server's own prompt cache (``sidecar.llamacache``): its rules, pure logic."""

from __future__ import annotations

import numpy as np
import pytest

from integrations.llama_server import Timings
from sidecar.config import load_settings
from sidecar.llamacache import MISSES_LIMIT, LlamaPromptCache
from sidecar.slots import SlotTable
from tiers.errors import ConfigError
from tiers.keys import common_prefix


def toks(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def reused(cache: LlamaPromptCache, held: np.ndarray, tokens: np.ndarray, owner: str = "") -> int:
    return cache.reused(held, tokens, common_prefix(held, tokens), owner)


def table_holding(*held: np.ndarray) -> SlotTable:
    table = SlotTable(len(held))
    for slot, tokens in enumerate(held):
        table.set_tokens(slot, tokens, owner="")
    return table


def test_a_prompt_overwritten_by_another_is_loaded_back_by_llama_server() -> None:
    conversation, other = toks(0, 1000), toks(50_000, 800)
    table = table_holding(conversation)
    cache = LlamaPromptCache(256, 100)
    assert reused(cache, conversation, other) == 0  # nothing in common, nothing cached yet
    cache.launched(table, 0, other)  # keeps under half of the slot: its prompt goes to the cache
    table.set_tokens(0, other)
    back = np.concatenate([conversation, toks(90_000, 20)])
    assert reused(cache, other, back) == 1000  # llama-server loads it in the same task
    cache.launched(table, 0, back)
    assert reused(cache, other, back) == 0  # a loaded entry leaves the cache


def test_a_continuation_or_an_empty_slot_does_not_touch_the_cache() -> None:
    conversation = toks(0, 1000)
    cache = LlamaPromptCache(256, 100)
    cache.entries.clear()
    table = table_holding(conversation)
    longer = np.concatenate([conversation, toks(7_000, 50)])
    cache.launched(table, 0, longer)  # keeps all of the slot: no update
    assert not cache.entries
    # An entry exists, but the slot is empty: llama-server's keep share of it is 0/0, no load.
    cache.launched(table_holding(conversation, np.zeros(0, np.int32)), 1, toks(50_000, 10))
    assert [e.tokens.size for e in cache.entries] == [1000]  # the idle slot 0 was saved
    assert reused(cache, np.zeros(0, np.int32), longer) == 0


def test_an_entry_that_keeps_under_a_quarter_of_itself_or_is_another_tenants_is_not_counted() -> None:
    long_doc = toks(0, 4000)
    cache = LlamaPromptCache(-1, 100)
    cache.launched(table_holding(long_doc), 0, toks(50_000, 10))
    asked = np.concatenate([long_doc[:900], toks(70_000, 100)])  # keeps 900 / 4000 < 0.25 of it
    assert reused(cache, toks(60_000, 10), asked) == 0
    asked = np.concatenate([long_doc[:1100], toks(70_000, 100)])
    assert reused(cache, toks(60_000, 10), asked) == 1100
    assert reused(cache, toks(60_000, 10), asked, "tenant-b") == 0  # the entry is tenant ""'s


def test_the_size_limit_drops_the_oldest_and_a_contained_prompt_replaces_its_prefix() -> None:
    cache = LlamaPromptCache(1, 1000)  # 1 MiB: ~1,048 tokens of 1,000 bytes
    empty = np.zeros(0, np.int32)
    cache.launched(table_holding(toks(0, 600), empty), 1, toks(20_000, 5))  # idle slot 0 saved
    cache.launched(table_holding(toks(30_000, 600), empty), 1, toks(20_000, 5))
    assert [int(e.tokens[0]) for e in cache.entries] == [30_000]  # the first went for room
    # Slot 1's prompt is overwritten (saved), then idle slot 0 holds more of the cached one.
    cache.launched(table_holding(toks(30_000, 700), toks(40_000, 1)), 1, toks(20_000, 5))
    assert [(int(e.tokens[0]), e.tokens.size) for e in cache.entries] == [(40_000, 1), (30_000, 700)]
    cache.launched(table_holding(toks(0, 2000)), 0, toks(90_000, 5))  # larger than the whole cache
    assert len(cache.entries) == 2


def test_answers_that_reuse_less_than_promised_turn_the_mirror_off() -> None:
    cache = LlamaPromptCache(256, 100)
    served = Timings(prompt_n=10, prompt_ms=1.0, predicted_n=1, predicted_ms=1.0, cache_n=990)
    missed = Timings(prompt_n=1000, prompt_ms=1.0, predicted_n=1, predicted_ms=1.0, cache_n=0)
    for _ in range(MISSES_LIMIT - 1):
        cache.answered(990, missed, 1000)
    cache.answered(990, served, 1000)  # a hit resets the count
    for _ in range(MISSES_LIMIT - 1):
        cache.answered(990, missed, 1000)
    assert cache.on
    cache.answered(990, missed, 1000)
    assert not cache.on
    assert reused(cache, toks(0, 10), toks(0, 20)) == 10  # off: the slot's own prefix only
    assert not LlamaPromptCache(0, 100).on


@pytest.mark.parametrize("value", ["-2", "lots", "1.5", ""])
def test_a_wrong_llama_cache_ram_stops_start_up(value: str) -> None:
    if value == "":  # an empty env var is unset
        assert load_settings(["--slot-dir", "/tmp"], env={"KVTIER_LLAMA_CACHE_RAM": value}).llama_cache_ram is None
        return
    with pytest.raises(ConfigError, match="llama_cache_ram"):
        load_settings(["--slot-dir", "/tmp", "--llama-cache-ram", value], env={})


def test_loading_an_entry_behind_others_of_other_lengths_takes_that_one_out() -> None:
    cache = LlamaPromptCache(256, 100)
    first, second = toks(0, 500), toks(20_000, 1000)
    cache.launched(table_holding(first, second, np.zeros(0, np.int32)), 2, toks(90_000, 5))  # both idle: saved
    table = table_holding(toks(40_000, 300))
    back = np.concatenate([second, toks(7_000, 9)])
    assert reused(cache, table.tokens(0), back) == 1000
    cache.launched(table, 0, back)
    assert [int(e.tokens[0]) for e in cache.entries] == [0, 40_000]


def test_without_a_size_limit_the_cache_keeps_at_most_the_context() -> None:
    cache = LlamaPromptCache(-1, 100, max_tokens=1500)
    for start in (0, 10_000, 20_000):  # three idle slots' prompts of 600 tokens
        cache.launched(table_holding(toks(start, 600), np.zeros(0, np.int32)), 1, toks(90_000, 5))
    assert [int(e.tokens[0]) for e in cache.entries] == [10_000, 20_000]
