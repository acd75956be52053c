"""In-process sessions and restores of states with a rest: Gemma 3's sliding window, lfm2's and mamba2's
recurrent state.

Gemma 3 270M (real weights, ``n_swa`` 512), a generated lfm2 (``tests/ggufgen.py``: attention
layers 1 and 3, short convolutions in 0 and 2) and a generated mamba2 (recurrent memory alone)
each answer a prompt in one ``llama_cpp.Llama`` (A), which saves the result as a session through
a real Valkey (and, through its ``KVTierCache``, as prefix chunks plus a tail that carries the
rest; for mamba2 one tail of every token, the whole recurrent state its rest). A fresh ``Llama`` of the same model (B, its
own cache and store, so everything comes from Valkey) restores it and continues: the restored
memory reads back byte for byte as A saved it, B evaluates only the new tokens and answers with
the greedy tokens of A continuing its own context (same threads and batch size; both evaluate the
new tokens in one batch). "Evaluated" counts the tokens a completion's prompt step hands to
``Llama.eval``.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import llama_cpp
import numpy as np
import pytest
import redis

from integrations.fingerprint import layout_fingerprint, memory_identity, memory_layout, model_identity
from integrations.llama_cpp_cache import KVTierCache, restore_session, save_session
from integrations.llama_cpp_state import load_seq_image, read_seq_image, whole_state_bytes
from integrations.memkind import MemoryKind
from integrations.stateparse import parse_state
from integrations.swa import gguf_sliding_window
from tests.ggufgen import ModelShape, write_random_model
from tests.inprocess import counting_llama
from tests.servers import RedisProc, gemma3_path, smollm2_path
from tiers.keys import Namespace

pytestmark = pytest.mark.llama

CHUNK = 256
N_SWA = 512  # Gemma 3 270M's sliding window, in tokens
N_PREDICT = 8
SESSION = "user-7:chat"


@dataclass(frozen=True, slots=True)
class Saved:
    kind: str  # the memory kind: kv_pair, hybrid or recurrent
    model: str
    held: list[int]  # what A's context held when it saved
    image: bytes  # A's sequence state then (llama_state_seq_get_data, as a slot-file image)
    follow: list[int]  # the next prompt's new tokens
    want: str  # A's greedy answer to held + follow, from its own context
    redis_url: str


def fresh(model: str) -> llama_cpp.Llama:
    return counting_llama(model)


def cache_of(llm: llama_cpp.Llama, saved: Saved) -> KVTierCache:
    return KVTierCache(llm, redis_url=saved.redis_url, chunk_tokens=CHUNK)


def answer(llm: llama_cpp.Llama, prompt: list[int]) -> tuple[str, int]:
    """(greedy text, tokens the prompt step evaluated)."""
    llm.evals.clear()  # type: ignore[attr-defined]
    text = llm.create_completion(prompt, max_tokens=N_PREDICT, temperature=0)["choices"][0]["text"]  # type: ignore[index]
    return text, llm.evals[0]  # type: ignore[attr-defined]


def notes(n: int) -> str:
    return " ".join(f"Note {i}: shelf {i} stores {i * 3} jars of {['jam', 'honey', 'tea'][i % 3]}." for i in range(n))


def save_on_a(kind: str, model: str, prompt: list[int], follow: list[int], redis_url: str) -> Saved:
    """A answers ``prompt`` with its cache set (chunks and a tail to Valkey), saves the session,
    then answers ``prompt``'s context + ``follow`` from its own context without the cache (its
    next save would replace the tail B restores)."""
    a = fresh(model)
    try:
        with KVTierCache(a, redis_url=redis_url, chunk_tokens=CHUNK) as cache:
            a.set_cache(cache)
            answer(a, prompt)
            save_session(a, SESSION)
            assert cache.flush() and cache.counters.saves == 1 and cache.counters.errors == 0
            held = a.input_ids[: a.n_tokens].tolist()
            image = bytes(read_seq_image(a))
            a.set_cache(None)
        want, evaluated = answer(a, held + follow)
        assert evaluated == len(follow)
        return Saved(kind, model, held, image, follow, want, redis_url)
    finally:
        a.close()


@pytest.fixture(scope="module")
def swa(redis_srv: RedisProc) -> Saved:
    """Gemma 3 270M, a prompt longer than its window (the saved window is cut)."""
    model = gemma3_path()
    llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    prompt = llm.tokenize(notes(40).encode())
    follow = llm.tokenize(b" Which shelf stores 30 jars?", add_bos=False)
    llm.close()
    return save_on_a("kv_pair", model, prompt, follow, redis_srv.url)


@pytest.fixture(scope="module")
def hybrid(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    shape = ModelShape(attn_layers=(1, 3), conv_kernel=4)
    model = write_random_model(tmp_path_factory.mktemp("lfm2") / "lfm2.gguf", smollm2_path(), shape,
                               arch="lfm2", seed=11)
    return save_on_a("hybrid", str(model), list(range(1000, 1400)), list(range(2000, 2010)), redis_srv.url)


@pytest.fixture(scope="module")
def recurrent(redis_srv: RedisProc, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    model = write_random_model(tmp_path_factory.mktemp("mamba2") / "mamba2.gguf", smollm2_path(),
                               ModelShape(conv_kernel=4, ssm_state=16), arch="mamba2", seed=11)
    return save_on_a("recurrent", str(model), list(range(1000, 1400)), list(range(2000, 2010)), redis_srv.url)


@pytest.fixture(params=["swa", "hybrid", "recurrent"], ids=["gemma3-swa", "lfm2-hybrid", "mamba2-recurrent"])
def saved(request: pytest.FixtureRequest) -> Saved:
    value: Saved = request.getfixturevalue(request.param)
    return value


@contextlib.contextmanager
def on_b(saved: Saved) -> Iterator[llama_cpp.Llama]:
    """A fresh ``Llama`` of ``saved``'s model."""
    llm = fresh(saved.model)
    try:
        yield llm
    finally:
        llm.set_cache(None)
        llm.close()


@pytest.fixture
def b(saved: Saved) -> Iterator[llama_cpp.Llama]:
    with on_b(saved) as llm:
        yield llm


def test_the_saved_state_carries_a_rest(saved: Saved) -> None:
    st = parse_state(saved.image)
    assert st.memory_kind == saved.kind and st.has_rest and st.store_reason is None
    if saved.kind == "kv_pair":
        (window,) = [s for s in st.caches[1].streams if s.n_cells]
        assert window.n_cells == N_SWA and int(window.pos.min()) == len(saved.held) - N_SWA
    else:
        assert st.recurrent is not None and st.recurrent.pos.tolist() == [len(saved.held) - 1]
        assert st.tail_only == (saved.kind == "recurrent") and bool(st.caches) != st.tail_only


def test_a_session_restores_the_same_memory_and_continues_like_a(saved: Saved, b: llama_cpp.Llama) -> None:
    with cache_of(b, saved) as cache:
        assert cache.info.memory_kind == saved.kind
        assert restore_session(b, SESSION, cache=cache) == len(saved.held)
        # What llama.cpp holds now is what A saved, byte for byte: kvtier's two masked cells below a
        # sliding window are restored, then left out again by the read (they are masked).
        assert bytes(read_seq_image(b)) == saved.image
        assert answer(b, saved.held + saved.follow) == (saved.want, len(saved.follow))


def test_the_prefix_cache_restores_the_whole_state(saved: Saved, b: llama_cpp.Llama) -> None:
    with cache_of(b, saved) as cache:
        b.set_cache(cache)
        assert answer(b, saved.held + saved.follow) == (saved.want, len(saved.follow))
        assert cache.counters.hits == 1 and cache.counters.tokens_restored == len(saved.held)
        assert cache.counters.saves == 1 and cache.counters.errors == 0  # B's answer is stored in turn


def test_a_prompt_that_stops_short_of_the_saved_state_restores_nothing(saved: Saved, b: llama_cpp.Llama) -> None:
    """Chunks alone lack the rest: a prompt that ends inside the saved tokens is computed."""
    short = saved.held[: 2 * CHUNK + 10]
    with cache_of(b, saved) as cache:
        assert cache.lookup(short) == 0
        b.set_cache(cache)
        _, evaluated = answer(b, short)
        assert evaluated == len(short) and cache.counters.hits == 0


def test_a_whole_context_state_names_the_sequence_of_its_recurrent_cells(saved: Saved, b: llama_cpp.Llama) -> None:
    """``Llama.load_state`` reads a whole-context state (``dest_seq_id`` -1): a one-sequence
    save's recurrent cells name no sequence and would belong to none; whole_state_bytes names 0."""
    with cache_of(b, saved) as cache:
        whole = whole_state_bytes(np.frombuffer(saved.image, np.uint8).copy(), cache.info.arch_header)
    buf = (ctypes.c_uint8 * whole.nbytes).from_buffer_copy(whole)
    assert llama_cpp.llama_state_set_data(b._ctx.ctx, buf, whole.nbytes) == whole.nbytes
    b.input_ids[: len(saved.held)] = saved.held
    b.n_tokens = len(saved.held)
    assert bytes(read_seq_image(b)) == saved.image
    assert llama_cpp.llama_memory_seq_pos_max(b._ctx.memory, 0) == len(saved.held) - 1


# -- sliding window ---------------------------------------------------------------------------------


def test_gemma3_window_size(swa: Saved) -> None:
    assert gguf_sliding_window(swa.model) == N_SWA


def test_in_process_the_window_needs_no_padding(swa: Saved) -> None:
    """llama-server keeps a restored prefix only while the memory's lowest position is below
    ``pos_next - n_swa``, which an unpadded window misses by one; ``Llama.generate`` does not
    check it: A's unpadded state, restored as it is, is reused like kvtier's padded one."""
    n = len(swa.held)
    with on_b(swa) as b:
        assert load_seq_image(b, swa.image) == n
        assert llama_cpp.llama_memory_seq_pos_min(b._ctx.memory, 0) == n - N_SWA  # not below n - N_SWA
        assert answer(b, swa.held + swa.follow) == (swa.want, len(swa.follow))


def test_a_prompt_that_leaves_a_restored_window_early_is_computed_from_the_start(swa: Saved) -> None:
    """A restored window holds the cells its last token sees, no more. ``Llama.generate`` would
    reuse any common prefix, and the queries after it would see a cut window; the cache set on the
    ``Llama`` empties the context first, so the prompt is computed as from an empty context."""
    early = swa.held[:300] + swa.follow  # no stored state continues it
    with on_b(swa) as b:
        with cache_of(b, swa) as cache:
            b.set_cache(cache)
            assert restore_session(b, SESSION, cache=cache) == len(swa.held)
            got = answer(b, early)
            b.set_cache(None)
        b.reset()  # type: ignore[no-untyped-call]
        assert got == answer(b, early) and got[1] == len(early)
        # What the guard prevents: without the cache on it, the Llama reuses 300 tokens of the cut
        # window (positions 0..157 of the sliding-window layers are gone) and answers otherwise.
        assert load_seq_image(b, swa.image) == len(swa.held)
        cut = answer(b, early)
        assert cut[1] == len(swa.follow) and cut[0] != got[0]


# -- recurrent state ----------------------------------------------------------------------------------


@pytest.fixture(params=["hybrid", "recurrent"], ids=["lfm2-hybrid", "mamba2-recurrent"])
def with_recurrent(request: pytest.FixtureRequest) -> Saved:
    value: Saved = request.getfixturevalue(request.param)
    return value


def test_a_recurrent_state_is_never_rewound(with_recurrent: Saved) -> None:
    """llama.cpp refuses to cut a recurrent state back (``llama_memory_seq_rm`` false), so a
    prompt that repeats the saved tokens, or leaves them earlier, is computed from the start."""
    saved = with_recurrent
    early = saved.held[:300] + saved.follow
    with on_b(saved) as reference:
        want = answer(reference, early)
    with on_b(saved) as b, cache_of(b, saved) as cache:
        for prompt in (saved.held, early):
            assert restore_session(b, SESSION, cache=cache) == len(saved.held)
            got = answer(b, prompt)
            assert got[1] == len(prompt)
        assert got == want


def test_the_prefix_cache_restores_a_recurrent_state_only_for_a_prompt_that_continues_it(
        with_recurrent: Saved) -> None:
    """No shorter prefix can be cut from a recurrent state: a prompt that stops inside the saved
    tokens, ends with them, or leaves them is computed from the start and answers as without the
    cache; one that continues them restores them all."""
    saved = with_recurrent
    n = len(saved.held)
    prompts = [saved.held[:300], saved.held, saved.held[:300] + saved.follow, saved.held[: n - 1] + saved.follow]
    with on_b(saved) as reference:
        want = [answer(reference, p) for p in prompts]
    for prompt, expected in zip(prompts, want, strict=True):
        with on_b(saved) as b, cache_of(b, saved) as cache:
            assert cache.lookup(prompt) == 0 and prompt not in cache
            b.set_cache(cache)
            assert answer(b, prompt) == expected and expected[1] == len(prompt)
            assert cache.counters.hits == 0 and cache.counters.errors == 0
    with on_b(saved) as b, cache_of(b, saved) as cache:
        assert cache.lookup(saved.held + saved.follow) == n and saved.held + saved.follow in cache


def test_the_namespace_is_the_sidecars(saved: Saved, b: llama_cpp.Llama) -> None:
    """A state with a rest is another format than a plain cache of the same layers: its own
    namespace, keyed as the sidecar keys it (model identity and memory kind, then the first cache's
    layout; for recurrent memory alone its recurrent layers' types and row sizes), with the
    function the sidecar keys by (``fingerprint.memory_layout``) for what the fingerprint covers."""
    st = parse_state(saved.image)
    identity = f"{model_identity(saved.model)}|memory={saved.kind}"
    assert memory_identity(model_identity(saved.model), MemoryKind(saved.kind)) == identity
    layout = memory_layout(st)  # what the sidecar's watcher keys its namespace by
    assert layout is not None
    with cache_of(b, saved) as cache:
        assert cache.info.layout == layout
        assert cache.namespace.id == Namespace(layout_fingerprint(identity, layout), chunk_tokens=CHUNK).id
        with redis.Redis.from_url(saved.redis_url) as r:
            assert r.keys(f"kvtier:{cache.namespace.id}:*")
