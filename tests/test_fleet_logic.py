"""The fleet view's and the router's pure parts: what a peer holds of a prompt, what a status may
say, and which node the cost model picks."""

from __future__ import annotations

import numpy as np

from sidecar.costmodel import CostModel
from sidecar.fleet import NodeStatus, PeerHeat, SlotHeat, hot_tokens, slot_heat
from sidecar.forward import FORWARD_OVERHEAD_S, choose_route
from tiers.keys import Namespace, prefix_chain

NS = Namespace("model-x", chunk_tokens=16)
TOKENS = np.arange(1000, 1100, dtype=np.int32)  # 100 tokens: 6 full chunks and a 4-token tail


def status(slots: list[SlotHeat], busy: int = 0, queue: int = 0, service_s: float = 4.0, node: str = "p") -> NodeStatus:
    return NodeStatus(node, "http://10.0.0.2:8081", tuple(slots), busy, queue, service_s)


def test_a_slot_holds_its_chunks_and_its_tail_only_when_the_prompt_continues_it() -> None:
    held = TOKENS[:70]  # 4 chunks and 6 tokens of tail
    chain, tail = slot_heat(NS, held)
    masks = [1 if h in chain else 0 for h in prefix_chain(NS, TOKENS)]
    st = status([SlotHeat(70, True, tail)])
    assert hot_tokens(st, masks, NS, TOKENS, prefix_chain(NS, TOKENS)) == 70
    other = TOKENS.copy()
    other[66] = 7  # the prompt leaves the slot inside its tail: only the chunks count
    masks = [1 if h in chain else 0 for h in prefix_chain(NS, other)]
    assert hot_tokens(st, masks, NS, other, prefix_chain(NS, other)) == 64
    busy = status([SlotHeat(70, False, tail)])
    assert hot_tokens(busy, masks, NS, other, prefix_chain(NS, other)) == 0  # a busy slot is not hot
    salted = NS.salted("tenant-b")  # another tenant's chain never meets this one
    assert not set(prefix_chain(salted, TOKENS)) & set(chain)


def test_a_status_is_a_hint_and_garbage_is_none() -> None:
    st = status([SlotHeat(70, True, b"\x01" * 16), SlotHeat(0, False, b"")], busy=1, queue=2)
    assert NodeStatus.parse(st.encode()) == st
    for bad in (b"", b"{", b'{"v": 2}', b"[]", st.encode().replace(b"http://", b"ftp://"), 42, None,
                st.encode().replace(b'"busy": 1', b'"busy": "x"')):
        assert NodeStatus.parse(bad) is None, bad


def test_with_a_key_a_status_without_its_mac_is_none() -> None:
    """A status names the URL requests go to: without the secret nobody can plant one."""
    key = b"a-secret-of-16-bytes-or-more"
    st = status([SlotHeat(70, True, b"")])
    signed = st.encode(key)
    assert NodeStatus.parse(signed, key) == st
    assert NodeStatus.parse(st.encode(), key) is None  # unsigned
    assert NodeStatus.parse(st.encode(b"another-secret-of-16-bytes"), key) is None
    forged = signed.replace(b"10.0.0.2", b"10.6.6.6")
    assert NodeStatus.parse(forged, key) is None


def test_the_wait_counts_the_queue_ahead_in_slots() -> None:
    idle = [SlotHeat(0, True, b"")] * 4
    assert status(idle, busy=3).wait_s() == 0.0  # a slot is free
    assert status(idle, busy=4).wait_s() == 1.0  # 1 ahead on 4 slots of 4 s
    assert status(idle, busy=4, queue=3).wait_s() == 4.0
    assert status(idle, busy=3).wait_s(extra=2) == 2.0  # and what this node already sent it


def test_the_router_forwards_to_the_sooner_peer_and_never_to_a_busy_one() -> None:
    cost = CostModel(prefill_tps=200.0, restore_gbps=0.5)
    n, b = 3000, 23_040
    found = {"redis": 2900 * b}  # the tiers hold the history too: a restore here is ~0.27 s
    idle = PeerHeat(status([SlotHeat(2900, True, b"")] * 2, node="idle"), 2900)
    loaded = PeerHeat(status([SlotHeat(2900, True, b"")] * 2, busy=2, queue=2, node="loaded"), 2900)
    route = choose_route(n, 0, 2900, found, [loaded, idle], cost)
    assert route.peer is idle and route.peer_s == FORWARD_OVERHEAD_S + 100 / 200
    assert route.here_restores == 2900 and route.bytes_not_moved == 2900 * b
    assert choose_route(n, 0, 2900, found, [loaded], cost).peer is None  # restore here instead
    assert choose_route(n, 2990, 2900, found, [idle], cost).peer is None  # the local slot holds more
    # Forwarding is counted against the peer: enough requests already sent make it lose.
    assert choose_route(n, 0, 2900, found, [idle], cost, in_flight={"idle": 2}).peer is None
    # Nothing stored, nothing local: a peer saves the whole prefill even with a short queue.
    assert choose_route(n, 0, 0, {}, [loaded], cost).peer is loaded


def test_the_router_counts_the_slots_a_prompt_would_be_computed_beside() -> None:
    """llama-server batches its computing slots together: on a CPU a peer with two of its three
    slots computing prefills slower (here at a third of the rate), so a restore on an idle node answers sooner;
    where the rate does not drop (a GPU), the hot peer still wins. This node's own computing
    slots count the same way against serving here."""
    n, b = 2100, 23_040
    found = {"redis": 2000 * b}  # a restore here: ~0.1 s
    two_busy = PeerHeat(status([SlotHeat(2000, True, b"")] * 3, busy=2, node="two-busy"), 2000)
    cpu = CostModel(prefill_tps=150.0, restore_gbps=0.5)
    cpu.observe_prefill(150, 1000, sharing=0)
    cpu.observe_prefill(150, 3000, sharing=2)
    assert choose_route(n, 0, 2000, found, [two_busy], cpu).peer is None  # 2 s there, 0.8 s here
    assert choose_route(n, 0, 2000, found, [two_busy], cpu, local_sharing=2).peer is two_busy  # busy alike
    flat = CostModel(prefill_tps=150.0, restore_gbps=0.5)
    flat.observe_prefill(150, 1000, sharing=0)
    flat.observe_prefill(150, 1000, sharing=2)
    assert choose_route(n, 0, 2000, found, [two_busy], flat).peer is two_busy
