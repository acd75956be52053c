"""Cache-aware forwarding: a completion goes to the sidecar whose slots hold its prefix hot.

Nodes A and B (in-process sidecars, forwarding on, each advertising its URL, a bearer token on
every endpoint) and node C (a ``kvtier serve`` process, so it can be stopped and killed), each
with its own llama-server and a shared Valkey. A conversation answered on one node whose next
turn reaches another is forwarded there, unless that node is busy; a peer that hangs or dies
leaves the request to the node it reached; a forwarded request is never sent on; tenants stay
apart.

Real llama-servers, a real Valkey, SmolLM2.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import pytest_asyncio
import redis

from launch import Node
from sidecar import planner
from sidecar.appkeys import FORWARDER, METRICS
from sidecar.cli_client import summarize_metrics
from sidecar.config import Settings
from sidecar.fleet import HEARTBEAT_TTL_S, NodeStatus
from sidecar.forward import LIVENESS_CHECK_S
from sidecar.http.headers import FORWARDED as FORWARDED_HEADER
from sidecar.http.headers import FORWARDED_TO as FORWARDED_TO_HEADER
from tests.servers import DEFAULT_LLAMA_ARGS, RedisProc, llama_server, smollm2_path
from tests.sidecars import Answer, Sidecar, post, post_stream, run_sidecar, stream_text
from tiers.keys import prefix_chain

pytestmark = pytest.mark.llama

CHUNK = 64
TOKEN = "fleet-token"
FLEET_KEY = "the-fleet-secret-of-this-test"  # --forward needs it: peers prove they belong with it
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOC = " ".join(f"Entry {i}: the {['red', 'blue', 'green', 'white'][i % 4]} box in room {i} holds {i * 5} keys."
               for i in range(40))


def chat(history: list[dict[str, str]], question: str, max_tokens: int = 8) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": "Answer from these entries. " + DOC}, *history,
                         {"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}


def turn_two(first: Answer, question: str = "What does room 3 hold?") -> dict[str, object]:
    return chat([{"role": "user", "content": question}, {"role": "assistant", "content": first.content}],
                "And room 8?")


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


def status_of(r: redis.Redis, node: str) -> NodeStatus | None:
    for key in r.scan_iter(match=f"kvtier:*:f:{node}".encode()):
        return NodeStatus.parse(r.hget(key, b"status"), FLEET_KEY.encode())
    return None


def hot_fields(r: redis.Redis, node: str) -> int:
    return sum(r.hlen(key) - 1 for key in r.scan_iter(match=f"kvtier:*:f:{node}".encode()))


def settings_for(llama_url: str, slot_dir: str, redis_url: str, node: str, **extra: object) -> Settings:
    return Settings(llama_url=llama_url, slot_dir=slot_dir, redis_url=redis_url, node_id=node, chunk_tokens=CHUNK,
                    cache_size=512 << 20, prefill_tps_prior=100.0, save_wait=0.0, forward=True,
                    auth_token=TOKEN, auth_all=True, chunk_key=FLEET_KEY, **extra)  # type: ignore[arg-type]


@pytest_asyncio.fixture(scope="module")
async def fleet(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
        tuple[Sidecar, Sidecar, redis.Redis]]:
    tmp = tmp_path_factory.mktemp("forwarding")
    with llama_server(tmp, "-np", "2") as la, llama_server(tmp, "-np", "2") as lb:
        async with run_sidecar(settings_for(la.url, str(la.slot_dir), redis_srv.url, "a"), advertise=True) as a, \
                run_sidecar(settings_for(lb.url, str(lb.slot_dir), redis_srv.url, "b"), advertise=True) as b:
            assert await a.engine.ensure_ready() and await b.engine.ensure_ready()
            await until(lambda: _async("a" in peers_of(b) and "b" in peers_of(a)), what="a and b see each other")
            with redis.Redis(port=redis_srv.port) as r:
                yield a, b, r


async def _async(value: bool) -> bool:
    return value


def peers_of(sidecar: Sidecar) -> list[str]:
    forwarder = sidecar.app[FORWARDER]
    assert forwarder is not None
    return forwarder.fleet.peers


async def test_a_turn_on_the_wrong_node_is_forwarded_where_it_is_hot(
        fleet: tuple[Sidecar, Sidecar, redis.Redis]) -> None:
    a, b, r = fleet
    url_a, url_b = a.url + "/v1/chat/completions", b.url + "/v1/chat/completions"
    # Two tenants, same conversation, each in its own slot of A, computed the same way.
    firsts = [await post(url_a, chat([], "What does room 3 hold?"), headers={**AUTH, "X-KVTier-Salt": t})
              for t in ("t1", "t2")]
    assert all(f.status == 200 for f in firsts) and firsts[0].content == firsts[1].content
    assert firsts[1].restored == 0 and firsts[1].prompt_n > 10 * CHUNK  # t2 did not get t1's slot
    await until(lambda: _async(hot_fields(r, "a") >= 2 * 10), what="A publishes both slots")
    # Both first turns' saves in Redis: what B would restore instead of forwarding (else a slow
    # save leaves B nothing to weigh, and no bytes are counted as not moved).
    await a.engine.drain(30)
    assert await a.store.flush(30)
    # The reference: t1's next turn sent straight to A, where its slot holds the history.
    reference = await post(url_a, turn_two(firsts[0]), headers={**AUTH, "X-KVTier-Salt": "t1"})
    assert reference.status == 200 and reference.prompt_n < CHUNK
    # t2's next turn reaches B: forwarded to A, computed there the same way, relayed unchanged.
    forwarded_in = a.metric("kvtier_route_forwarded_in_total")
    answer = await post(url_b, turn_two(firsts[1]), headers={**AUTH, "X-KVTier-Salt": "t2"})
    assert answer.status == 200, answer.text
    assert answer.headers.get(FORWARDED_TO_HEADER) == "a"
    assert answer.content == reference.content
    # Computed from t2's own slot (t1's holds the whole prompt and more: it would compute 1 token).
    assert answer.prompt_n == reference.prompt_n > 1
    assert a.metric("kvtier_route_forwarded_in_total") == forwarded_in + 1
    assert b.metric("kvtier_route_decisions_total", decision="forwarded") == 1
    assert b.metric("kvtier_route_bytes_not_moved_total") > 10 * CHUNK * 10_000  # ~23 KB per token
    assert b.metric("kvtier_tokens_recomputed_total") == 0  # B's llama-server never saw it
    assert b.metric("kvtier_bytes_restored_total") == 0
    routing = summarize_metrics(b.app[METRICS].render().decode())["routing"]  # what `kvtier stats` shows
    assert routing["forwarded"] == 1 and routing["bytes_not_moved"] == b.metric("kvtier_route_bytes_not_moved_total")


async def test_a_busy_peer_is_not_chosen(fleet: tuple[Sidecar, Sidecar, redis.Redis],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, r = fleet
    first = await post(a.url + "/v1/chat/completions", chat([], "What does room 5 hold?"),
                       headers={**AUTH, "X-KVTier-Salt": "t3"})
    assert first.status == 200
    await until(lambda: _async((s := status_of(r, "a")) is not None and s.busy == 0 and s.queue == 0), what="A idle")
    await a.engine.drain(30)  # A's save is in the tiers: B's restore does not race it
    assert await a.store.flush(30)
    other = 1 - int(first.headers["X-KVTier-Slot"])
    # A's other slot runs one long answer and two more wait for it: A is busy.
    long_ones = [asyncio.create_task(post(a.url + "/completion", {
        "prompt": f"Count from {i} to one thousand:", "n_predict": 64, "id_slot": other, "temperature": 0},
        headers=AUTH)) for i in range(3)]
    try:
        await until(lambda: _async((s := status_of(r, "a")) is not None and s.queue >= 1), what="A queues")
        decided = b.metric("kvtier_route_decisions_total", decision="served_here")
        # The route check's lookup is the one B restores by (fresh however slow this machine is).
        monkeypatch.setattr(planner, "EARLY_LOOKUP_S", 60.0)
        lookups = count_calls(monkeypatch, b.store, "lookup_chain")
        answer = await post(b.url + "/v1/chat/completions", turn_two(first, "What does room 5 hold?"),
                            headers={**AUTH, "X-KVTier-Salt": "t3"})
    finally:
        done = await asyncio.gather(*long_ones)
    assert all(d.status == 200 for d in done)
    assert answer.status == 200 and FORWARDED_TO_HEADER not in answer.headers
    assert b.metric("kvtier_route_decisions_total", decision="served_here") == decided + 1
    assert answer.restored > 10 * CHUNK and answer.prompt_n < CHUNK  # restored on B instead
    assert lookups == [1]  # the tiers were looked up once, not again once a slot was taken


def count_calls(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> list[int]:
    """Count the calls of ``obj.name`` (a coroutine method) from now on, in a one-item list."""
    calls = [0]
    method = getattr(obj, name)

    async def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return await method(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


async def test_a_forwarded_request_is_never_forwarded_again(fleet: tuple[Sidecar, Sidecar, redis.Redis]) -> None:
    a, b, r = fleet
    first = await post(a.url + "/v1/chat/completions", chat([], "What does room 6 hold?"),
                       headers={**AUTH, "X-KVTier-Salt": "t4"})
    assert first.status == 200
    await until(lambda: _async((s := status_of(r, "a")) is not None and s.busy == 0), what="A idle")
    await a.engine.drain(30)  # A's save is in the tiers: what B restores does not race it
    assert await a.store.flush(30)
    received = b.metric("kvtier_route_forwarded_in_total")
    forwarded = b.metric("kvtier_route_decisions_total", decision="forwarded")
    answer = await post(b.url + "/v1/chat/completions", turn_two(first, "What does room 6 hold?"),
                        headers={**AUTH, "X-KVTier-Salt": "t4", FORWARDED_HEADER: "x"})
    assert answer.status == 200 and FORWARDED_TO_HEADER not in answer.headers
    assert answer.restored > 10 * CHUNK  # served on B, from what A stored
    assert b.metric("kvtier_route_forwarded_in_total") == received + 1
    assert b.metric("kvtier_route_decisions_total", decision="forwarded") == forwarded


async def test_tenants_never_see_each_others_slots(fleet: tuple[Sidecar, Sidecar, redis.Redis]) -> None:
    a, b, r = fleet
    first = await post(a.url + "/v1/chat/completions", chat([], "What does room 7 hold?"),
                       headers={**AUTH, "X-KVTier-Salt": "t5"})
    assert first.status == 200
    await until(lambda: _async((s := status_of(r, "a")) is not None and s.busy == 0), what="A idle")
    forwarded_in = a.metric("kvtier_route_forwarded_in_total")
    # Another tenant with t5's whole conversation: nothing of it is hot for them anywhere.
    other = await post(b.url + "/v1/chat/completions", turn_two(first, "What does room 7 hold?"),
                       headers={**AUTH, "X-KVTier-Salt": "t6"})
    assert other.status == 200 and FORWARDED_TO_HEADER not in other.headers
    assert other.restored == 0 and other.prompt_n > 10 * CHUNK
    assert a.metric("kvtier_route_forwarded_in_total") == forwarded_in
    # The same request as t5 is forwarded; without the token it is refused before anything.
    status, events, headers = await post_stream(b.url + "/v1/chat/completions",
                                                turn_two(first, "What does room 7 hold?"),
                                                headers={**AUTH, "X-KVTier-Salt": "t5"})
    assert status == 200 and headers.get(FORWARDED_TO_HEADER) == "a"
    assert events[-1] == "[DONE]" and stream_text(events)  # the peer's stream, relayed as it came
    assert [e for e in events if isinstance(e, dict) and "timings" in e][-1]["timings"]["prompt_n"] < CHUNK
    refused = await post(b.url + "/v1/chat/completions", turn_two(first, "What does room 7 hold?"),
                         headers={"X-KVTier-Salt": "t5"})
    assert refused.status == 401 and a.metric("kvtier_route_forwarded_in_total") == forwarded_in + 1


async def test_a_node_learns_its_prefill_rate_beside_its_computing_slots(
        fleet: tuple[Sidecar, Sidecar, redis.Redis]) -> None:
    """What the router compares nodes by: a prompt begun while another slot computes is learned
    apart from one computed alone (each tenant's prompt is computed whole: no slot holds it)."""
    a, _, r = fleet
    await until(lambda: _async((s := status_of(r, "a")) is not None and s.busy == 0), what="A idle")
    await a.engine.drain(30)
    cost = a.engine.cost
    before = [level.samples for level in cost.prefill_shared]
    first = asyncio.create_task(post(a.url + "/v1/chat/completions", chat([], "What does room 11 hold?", 32),
                                     headers={**AUTH, "X-KVTier-Salt": "t20"}))
    await until(lambda: _async(a.engine.slots is not None and a.engine.slots.computing == 1), what="one computing")
    second = await post(a.url + "/v1/chat/completions", chat([], "What does room 12 hold?"),
                        headers={**AUTH, "X-KVTier-Salt": "t21"})
    assert (await first).status == 200 and second.status == 200
    await a.engine.drain(30)  # the rates are learned after each answer, before its save
    after = [level.samples for level in cost.prefill_shared]
    assert after[0] == before[0] + 1 and after[1] == before[1] + 1, (before, after)
    assert cost.prefill_rate(1) == cost.prefill_shared[1].value
    assert a.metric("kvtier_prefill_tokens_per_second", beside="1") == cost.prefill_shared[1].value
    # ...and by length, over all levels (what a recompute of about as many tokens is priced at).
    by_length = {label: rate.value for label, rate in zip(cost.LENGTH_LABELS, cost.prefill_by_length[-1],
                                                          strict=True) if rate.samples}
    assert by_length and all(a.metric("kvtier_prefill_length_tokens_per_second", tokens=label) == value
                             for label, value in by_length.items()), by_length


@pytest.fixture
def node_c(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = Node("c", tmp_path_factory.mktemp("forwarding-c"), smollm2_path(), [*DEFAULT_LLAMA_ARGS, "-np", "2"],
                redis_srv.url, CHUNK, extra_sidecar_args=["--prefill-tps-prior", "100", "--save-wait", "0",
                                    "--chunk-key", FLEET_KEY],
                advertise=True)
    node.start(with_sidecar=True)
    try:
        yield node
    finally:
        for proc in (node.sidecar, node.llama.process):  # a test that failed may have left one stopped
            if proc is not None and proc.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.proc.pid, signal.SIGCONT)
        node.stop()


async def test_a_dead_or_hung_peer_leaves_the_request_here(
        fleet: tuple[Sidecar, Sidecar, redis.Redis], node_c: Node) -> None:
    _, b, r = fleet
    assert node_c.sidecar is not None and node_c.sidecar.proc is not None
    pid = node_c.sidecar.proc.pid
    url_c = node_c.sidecar_url + "/v1/chat/completions"

    async def c_holds(body: dict[str, object], salt: str) -> bool:
        """Whether B's view of the fleet shows C holding most of ``body``'s prompt hot."""
        forwarder = b.app[FORWARDER]
        assert forwarder is not None and "c" in forwarder.fleet.peers
        prompt = await b.engine.prompts.prompt_for("chat", body)
        namespace = b.engine.target.namespace_for(salt)
        peers = await forwarder.fleet.lookup(namespace, prompt.tokens, prefix_chain(namespace, prompt.tokens))
        return any(p.status.node == "c" and p.hot_tokens > 10 * CHUNK for p in peers)

    async def on_c(question: str, salt: str) -> Answer:
        chunks = len(r.keys(b"kvtier:*:c:*"))
        first = await post(url_c, chat([], question), headers={"X-KVTier-Salt": salt})
        assert first.status == 200
        await until(lambda: c_holds(turn_two(first, question), salt), what="B sees C holding it")
        # C's save reached Redis (its chunks are written behind): B can restore once C is gone.
        await until(lambda: _async(len(r.keys(b"kvtier:*:c:*")) >= chunks + 10), what="C's chunks in Redis")
        return first

    def lost() -> float:  # seconds failed forwards cost B so far
        return b.metric("kvtier_route_fallback_seconds_sum")

    # C's llama-server hangs behind its live sidecar: C withdraws from the view once its health
    # check fails (a 5 s timeout, every 2 s), and B serves C's conversation without trying C.
    first = await on_c("What does room 15 hold?", "t11")
    assert node_c.llama.process is not None and node_c.llama.process.proc is not None
    llama_pid = node_c.llama.process.proc.pid
    os.kill(llama_pid, signal.SIGSTOP)
    try:
        await until(lambda: _async("c" not in peers_of(b) and status_of(r, "c") is None), timeout=15,
                    what="C withdraws")
        answer = await post(b.url + "/v1/chat/completions", turn_two(first, "What does room 15 hold?"),
                            headers={**AUTH, "X-KVTier-Salt": "t11"})
    finally:
        os.kill(llama_pid, signal.SIGCONT)
    assert answer.status == 200 and FORWARDED_TO_HEADER not in answer.headers and answer.restored > 10 * CHUNK
    assert lost() == 0 and b.metric("kvtier_route_decisions_total", decision="fallback") == 0
    await until(lambda: _async("c" in peers_of(b)), timeout=15, what="C is back in the view")
    # Hung: C's sidecar stops answering (its socket still accepts); B gives up once C's entry expires.
    first = await on_c("What does room 9 hold?", "t7")
    os.kill(pid, signal.SIGSTOP)
    answer = await post(b.url + "/v1/chat/completions", turn_two(first, "What does room 9 hold?"),
                        headers={**AUTH, "X-KVTier-Salt": "t7"})
    os.kill(pid, signal.SIGCONT)
    assert answer.status == 200 and FORWARDED_TO_HEADER not in answer.headers
    assert answer.restored > 10 * CHUNK  # served on B from what C stored
    assert b.metric("kvtier_route_forward_failures_total", reason="gone") == 1
    hung = lost()
    assert 0 < hung < HEARTBEAT_TTL_S + LIVENESS_CHECK_S + 0.5, hung  # C's entry expired: the bound
    # Dead: C's sidecar is killed; its entry is still there, its port refuses at once.
    first = await on_c("What does room 11 hold?", "t8")
    os.kill(pid, signal.SIGKILL)
    answer = await post(b.url + "/v1/chat/completions", turn_two(first, "What does room 11 hold?"),
                        headers={**AUTH, "X-KVTier-Salt": "t8"})
    assert answer.status == 200 and FORWARDED_TO_HEADER not in answer.headers and answer.restored > 10 * CHUNK
    assert b.metric("kvtier_route_forward_failures_total", reason="connect") == 1
    assert lost() - hung < 0.5, lost() - hung  # refused at once
    assert b.metric("kvtier_route_decisions_total", decision="fallback") == 2


async def test_a_session_turn_is_forwarded_and_its_session_saved_as_if_served_there(
        fleet: tuple[Sidecar, Sidecar, redis.Redis]) -> None:
    a, b, r = fleet
    session = {**AUTH, "X-KVTier-Salt": "t9", "X-Session-Id": "forwarded-chat"}
    first = await post(a.url + "/v1/chat/completions", chat([], "What does room 13 hold?"), headers=session)
    assert first.status == 200
    await until(lambda: _async((s := status_of(r, "a")) is not None and s.busy == 0), what="A idle")
    # Turn 2 reaches B: forwarded to A, whose slot holds the session's history.
    second_body = turn_two(first, "What does room 13 hold?")
    second = await post(b.url + "/v1/chat/completions", second_body, headers=session)
    assert second.status == 200 and second.headers.get(FORWARDED_TO_HEADER) == "a"
    assert second.prompt_n < CHUNK
    await a.engine.drain(30)  # A saved the session as of turn 2, into the shared tiers
    assert await a.store.flush(30)
    target = b.engine.target
    assert target is not None
    saved = await b.engine.sessions.load(target.namespace_for("t9"), "forwarded-chat")
    assert saved.node == "a" and saved.n_tokens > second.body["timings"]["cache_n"] + second.prompt_n
    # Turn 3 is served on B (a forwarded copy is never sent on): it restores the session A saved.
    third_body = {**second_body, "messages": [*second_body["messages"],  # type: ignore[list-item]
                                              {"role": "assistant", "content": second.content},
                                              {"role": "user", "content": "And room 11?"}]}
    third = await post(b.url + "/v1/chat/completions", third_body, headers={**session, FORWARDED_HEADER: "x"})
    assert third.status == 200 and FORWARDED_TO_HEADER not in third.headers
    assert third.restored == saved.n_tokens  # the whole history, to turn 2's answer
    assert third.prompt_n < CHUNK
    # Another tenant with the same session id has no such session: nothing restored.
    other = await post(b.url + "/v1/chat/completions", third_body,
                       headers={**session, "X-KVTier-Salt": "t10", FORWARDED_HEADER: "x"})
    assert other.status == 200 and other.restored == 0


async def test_a_next_turn_sent_at_once_follows_its_history_while_it_is_saved(
        fleet: tuple[Sidecar, Sidecar, redis.Redis]) -> None:
    a, b, _ = fleet
    headers = {**AUTH, "X-KVTier-Salt": "t12"}
    first = await post(a.url + "/v1/chat/completions", chat([], "What does room 17 hold?"), headers=headers)
    assert first.status == 200
    # No pause: A is still saving turn 1 (its slot table does not know the new tokens yet), yet
    # the fleet view already names the prompt it answered, and turn 2 goes there.
    second = await post(b.url + "/v1/chat/completions", turn_two(first, "What does room 17 hold?"), headers=headers)
    assert second.status == 200 and second.headers.get(FORWARDED_TO_HEADER) == "a"
    assert second.prompt_n < CHUNK and second.restored == 0
