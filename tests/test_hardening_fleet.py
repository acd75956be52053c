"""Hardening of the forwarding fleet against whoever can write to Redis (issue 30, items 8-12).

What a Redis writer could do before: plant a node that receives forwarded chats (no secret was
required), replay a dead node's signed status forever (its MAC had no expiry) and make requests
hang, slow every request down with a huge node directory, steer the forward URL with a URL the
reader never checked, and make a node restore another conversation's cells through a forged
prefix reference. Each test below shows one of those is gone: against a real Valkey, and for the
forwarding path a real llama-server and sidecar.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from integrations import kvflow, prefixrefs
from integrations.chunks import assemble_state
from sidecar.config import load_settings
from sidecar.fleet import NodeStatus, SlotHeat
from sidecar.peerurl import parse_peer_url
from tests.test_engine_parts import NS, memory_store, state_of
from tests.test_statefile import logical, ref_file
from tiers.errors import ConfigError
from tiers.keys import chunk_key, prefix_chain, tail_hash_after

KEY = b"a-fleet-secret-of-the-tests"
C = NS.chunk_tokens


# ------------------------------------------------------------------ item 8: a fleet secret, always


def test_forward_needs_the_fleet_secret() -> None:
    """--forward sends prompts and bearer tokens to the URLs the fleet view names: without the
    secret whoever can write to Redis could name their own, so kvtier refuses to start."""
    base = ["--slot-dir", "/tmp/slots", "--redis-url", "redis://127.0.0.1:6379/0", "--forward"]
    with pytest.raises(ConfigError, match="forward needs chunk_key"):
        load_settings(base, env={})
    assert load_settings(base, env={"KVTIER_CHUNK_KEY": KEY.decode()}).forward
    assert load_settings(["--slot-dir", "/tmp/slots", "--redis-url", "redis://127.0.0.1:6379/0",
                          "--advertise-url", "http://10.0.0.2:8081"], env={}).advertise_url  # publishing alone: no


# ----------------------------------------------------------- item 11: advertise URLs are checked


@pytest.mark.parametrize("url", [
    "http://10.0.0.2:8081/v1", "http://10.0.0.2:8081?x=1", "http://10.0.0.2:8081#f", "http://u@10.0.0.2:8081",
    "http://u:p@10.0.0.2", "ftp://10.0.0.2:8081", "http://:8081", "http://10.0.0.2:0", "http://10.0.0.2:99999",
    "http://10.0.0.2:", "http://10.0.0.2:80x", "http://bad_host:1", "http://h\n.x:1", "http://[::1:1",
    "http://evil.example%2f:1", "http://10.0.0.2:8081?",
])
def test_a_bad_advertise_url_is_refused_in_config_and_in_the_fleet_view(url: str) -> None:
    with pytest.raises(ConfigError, match="advertise_url"):
        load_settings(["--slot-dir", "/tmp/slots", "--advertise-url", url], env={})
    assert NodeStatus.parse(NodeStatus("p", url, (SlotHeat(64, True, b""),), 0, 0, 1.0).encode(KEY), KEY) is None


def test_the_forward_url_is_built_from_the_checked_parts() -> None:
    assert parse_peer_url("http://10.0.0.2").forward_url("/v1/chat/completions?a=1") == \
        "http://10.0.0.2:80/v1/chat/completions?a=1"
    assert parse_peer_url("https://node-1.fleet.svc/").forward_url("/completion") == \
        "https://node-1.fleet.svc:443/completion"
    assert parse_peer_url("http://[fd00::2]:8081").forward_url("/x") == "http://[fd00::2]:8081/x"
    with pytest.raises(ValueError):
        parse_peer_url("http://10.0.0.2:8081").forward_url("@evil.example/x")


# --------------------------------------------- item 12: a prefix reference cannot restore a wrong one


async def test_a_forged_prefix_reference_restores_nothing_wrong_and_is_counted() -> None:
    """Without a chunk key anyone who can write to Redis can write a reference. Before, one
    naming another conversation's chunk made a node restore that chunk's cells for this prompt.
    Now a reference carries the tokens of the value it names; they must start with the prompt's
    and the value's key is derived from the prompt's own prefix and them: a forged one is a miss,
    deleted and counted."""
    store = memory_store()
    mine, other = logical(200, seed=21), logical(200, seed=22)
    await kvflow.store_state(store, NS, state_of(mine))
    await kvflow.store_state(store, NS, state_of(other))
    prompt = np.asarray(mine.tokens[:100] + [7] * 60, np.int32)  # shares 100 tokens with `mine`
    found = await kvflow.find_prefix(store, NS, prompt)
    assert found.n_tokens == 96  # the genuine reference: cells 64..95 of mine's chunk 1
    genuine = await kvflow.fetch_prefix(store, NS, found)
    assert bytes(assemble_state(genuine.payloads, prompt, v_trans=False)) == ref_file(mine.prefix(96))
    mine_chain = prefix_chain(NS, np.asarray(mine.tokens, np.int32))
    other_chain = prefix_chain(NS, np.asarray(other.tokens, np.int32))
    under = tail_hash_after(mine_chain[0], prompt[C: C + 48])  # the prompt's key for 48 cells after chunk 0

    async def restored_with(forged: bytes, counted: bool) -> None:
        await store.store_tails(NS, [(under, forged, 48)])
        found = await kvflow.find_prefix(store, NS, prompt)
        assert found.n_tokens == C + 48  # the forged reference is what the lookup finds
        corrupt = store.counters.corrupt
        got = await kvflow.fetch_prefix(store, NS, found)
        assert got.n_tokens == C, got.n_tokens  # chunk 0 only: never the other conversation's cells
        assert bytes(assemble_state(got.payloads, prompt[:C + 1], v_trans=False)) == ref_file(mine.prefix(C))
        if counted:  # refused: counted and deleted (the genuine reference is found again)
            assert store.counters.corrupt == corrupt + 1
            assert (await kvflow.find_prefix(store, NS, prompt)).n_tokens == 96

    # The reference format before: it named another conversation's chunk by key and hash.
    await restored_with(struct.pack("<4sI16s", b"KVRF", 48, other_chain[1]) + chunk_key(NS, other_chain[1]), True)
    # Today's format carrying the other conversation's tokens: they are not the prompt's.
    others = np.asarray(other.tokens[C: 2 * C], np.int32)
    await restored_with(prefixrefs.ref_payload(prefixrefs.REF_CHUNK, others, 48), True)
    # The prompt's tokens, then others': the key they derive holds nothing (a plain miss).
    claimed = np.concatenate([prompt[C: C + 48], np.asarray(other.tokens[112:128], np.int32)])
    await restored_with(prefixrefs.ref_payload(prefixrefs.REF_CHUNK, claimed, 48), False)
    # A reference may only be shorter than the value it names, and a chunk is a whole chunk.
    await restored_with(prefixrefs.ref_payload(prefixrefs.REF_CHUNK, prompt[C: C + 48], 48), True)


