"""The state codec against real llama-server processes (SmolLM2 and a generated random model).

Flow of every restore test: a completion on server A, ``/slots/{id}?action=save``, parse + split,
assemble a prefix of chunks for server B's layout, ``/slots/{id}?action=restore`` on B, the same
completion on B. B must compute only the suffix (``timings.prompt_n``) and, where the V layout is
unchanged, give exactly the tokens of an uninterrupted run on B. At most two servers run at once
(2-core machines): ``ServerPool`` stops the least recently used one, and the tests are ordered so
that each configuration starts once.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integrations.chunkassemble import assemble_state
from integrations.chunksplit import split_state
from integrations.fingerprint import inspect_main, layout_fingerprint, model_identity
from integrations.stateparse import parse_state
from integrations.statewrite import write_state
from tests.ggufgen import ModelShape, write_random_llama
from tests.servers import DEFAULT_LLAMA_ARGS, LlamaServer, smollm2_path
from tiers.errors import StateFormatError
from tiers.keys import Namespace

pytestmark = pytest.mark.llama

CHUNK = 64
N_PREDICT = 16
# |p_restored - p_recomputed| of the top-5 tokens across V layouts. Observed here: 0.015 (fa -> nofa)
# and 0.050 (nofa -> fa), against 0.032 between full recomputes with and without flash attention:
# the K/V themselves differ (layers >= 1) between the two kernels, so a restored prefix carries the
# source's numerics into the target.
PROB_TOLERANCE = 0.1

CONFIGS: dict[str, tuple[str, ...]] = {
    "fa": ("-c", "2048", "-fa", "on"),
    "np4": ("-c", "4096", "-fa", "on", "-np", "4"),  # one stream per slot: n_stream = 4
    "nofa": ("-c", "2048", "-fa", "off"),
    "unified": ("-c", "2048", "-fa", "off", "-np", "4", "--kv-unified"),  # n_stream = 1
    "q8": ("-c", "2048", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),
    "random": ("-c", "2048", "-fa", "off"),
}
RANDOM_SHAPE = ModelShape(n_layer=3, n_embd=256, n_head=8, n_head_kv=2, head_dim=128, n_ff=512)

PROMPT = " ".join(
    f"Entry {i}: the {['red', 'green', 'blue', 'small', 'heavy'][i % 5]} crate in aisle {i * 7 % 13} holds "
    f"{i * 11 % 17} tins of {['peas', 'beans', 'soup', 'tea'][i % 4]}."
    for i in range(24)
) + " Summarise the inventory:"


class ServerPool:
    """Named llama-servers, started on demand, at most ``limit`` running at once."""

    def __init__(self, root: Path, models: dict[str, str], limit: int = 2):
        self.root, self.models, self.limit = root, models, limit
        self.running: dict[str, LlamaServer] = {}

    def get(self, name: str) -> LlamaServer:
        srv = self.running.pop(name, None)
        if srv is None:
            while len(self.running) >= self.limit:
                oldest = next(iter(self.running))
                self.running.pop(oldest).stop()
            srv = LlamaServer(self.models.get(name, smollm2_path()), [*DEFAULT_LLAMA_ARGS, *CONFIGS[name]],
                              self.root / f"slots-{name}")
            srv.start()
        self.running[name] = srv  # most recently used last
        return srv

    def close(self) -> None:
        for srv in self.running.values():
            srv.stop()
        self.running.clear()


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model") / "random-llama.gguf"
    return str(write_random_llama(path, smollm2_path(), RANDOM_SHAPE, seed=7))


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, random_model: str) -> Iterator[ServerPool]:
    p = ServerPool(tmp_path_factory.mktemp("llama"), {"random": random_model})
    try:
        yield p
    finally:
        p.close()


def identity(path: str, tmp_path: Path) -> str:
    # Not KVTIER_CACHE: it also locates the llama-server build.
    return model_identity(path, cache_file=tmp_path / "model-ids.json")


# -- HTTP helpers ---------------------------------------------------------------------------------


def post(srv: LlamaServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def complete(srv: LlamaServer, slot: int, n_probs: int = 0) -> dict[str, Any]:
    return post(srv, "/completion", {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "cache_prompt": True,
                                     "id_slot": slot, "return_tokens": True, "n_probs": n_probs})


def fresh_complete(srv: LlamaServer, slot: int, n_probs: int = 0) -> dict[str, Any]:
    """An uninterrupted run: the slot is emptied first, so the whole prompt is computed."""
    post(srv, f"/slots/{slot}?action=erase", {})
    out = complete(srv, slot, n_probs)
    assert out["timings"]["cache_n"] == 0
    return out


def save(srv: LlamaServer, slot: int, name: str = "saved.bin") -> bytes:
    res = post(srv, f"/slots/{slot}?action=save", {"filename": name})
    data = (srv.slot_dir / name).read_bytes()
    assert res["n_written"] == len(data)
    return data


def target_streams(srv: LlamaServer, slot: int) -> int:
    """The target's n_stream, read from the state file of an empty slot (36 bytes for one stream)."""
    post(srv, f"/slots/{slot}?action=erase", {})
    return parse_state(save(srv, slot, "empty.bin")).n_stream or 0


def restore(srv: LlamaServer, slot: int, data: bytes | memoryview) -> dict[str, Any]:
    post(srv, f"/slots/{slot}?action=erase", {})
    (srv.slot_dir / "restore.bin").write_bytes(data)
    return post(srv, f"/slots/{slot}?action=restore", {"filename": "restore.bin"})


@dataclass
class Moved:
    reference: dict[str, Any]  # an uninterrupted run on dst
    restored: dict[str, Any]  # the run on dst after the restore
    n_restored: int
    source: dict[str, Any] | None  # the fresh run on src that computed the moved KV


def move_prefix(src: LlamaServer, src_slot: int, dst: LlamaServer, dst_slot: int, *, v_trans: bool,
                n_probs: int = 0) -> Moved:
    """Save on src, restore the longest chunk prefix below the prompt on dst, complete there."""
    n_stream = target_streams(dst, dst_slot)
    reference = fresh_complete(dst, dst_slot, n_probs)
    n_prompt = reference["timings"]["prompt_n"]
    source = None
    if src is not dst or src_slot != dst_slot:
        # Computed on src itself: its slot may still hold KV restored there by an earlier test.
        source = fresh_complete(src, src_slot, n_probs)
    state = parse_state(save(src, src_slot))
    assert state.splittable, state.split_reason
    split = split_state(state, CHUNK)
    k = (n_prompt - 1) // CHUNK  # at least one prompt token is left to compute
    assert k >= 4
    data = assemble_state(split.chunks[:k], split.tokens, v_trans=v_trans, n_stream=n_stream)
    res = restore(dst, dst_slot, data)
    assert res["n_restored"] == k * CHUNK
    return Moved(reference, complete(dst, dst_slot, n_probs), k * CHUNK, source)


def assert_same_run(moved: Moved) -> None:
    reference, restored, n_restored = moved.reference, moved.restored, moved.n_restored
    assert restored["timings"]["cache_n"] == n_restored
    assert restored["timings"]["prompt_n"] == reference["timings"]["prompt_n"] - n_restored
    assert restored["tokens"] == reference["tokens"]
    assert restored["content"] == reference["content"]


def top_prob_diff(reference: dict[str, Any], restored: dict[str, Any], n_tokens: int = 4) -> float:
    """Largest |p| difference over the top-5 tokens of the first generated tokens (same top-1 required)."""
    worst = 0.0
    for a, b in list(zip(reference["completion_probabilities"], restored["completion_probabilities"]))[:n_tokens]:
        pa = {t["id"]: math.exp(t["logprob"]) for t in a["top_logprobs"]}
        pb = {t["id"]: math.exp(t["logprob"]) for t in b["top_logprobs"]}
        assert a["top_logprobs"][0]["id"] == b["top_logprobs"][0]["id"]
        for tok in set(pa) | set(pb):
            worst = max(worst, abs(pa.get(tok, 0.0) - pb.get(tok, 0.0)))
    return worst


# -- tests (ordered: each server configuration starts once) ----------------------------------------


def test_real_slot_file_parses_and_inspects(pool: ServerPool, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    srv = pool.get("fa")
    post(srv, "/slots/0?action=erase", {})
    empty = save(srv, 0, "empty.bin")
    assert len(empty) == 36 and parse_state(empty).n_stream == 1
    run = complete(srv, 0)
    data = save(srv, 0)
    state = parse_state(data)
    n = run["timings"]["prompt_n"] + N_PREDICT - 1  # the last generated token is never evaluated
    assert state.tokens.format == "packed" and state.n_tokens == n
    assert state.tokens.tokens[-(N_PREDICT - 1):].tolist() == run["tokens"][: N_PREDICT - 1]
    assert state.splittable and state.v_trans is False and state.n_stream == 1
    assert state.layout is not None and state.layout.n_layer == 30 and state.layout.bytes_per_token == 23040
    assert bytes(write_state(state)) == data  # byte-exact on a real file
    (tmp_path / "slot.bin").write_bytes(data)
    assert inspect_main([str(tmp_path / "slot.bin"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["n_tokens"], info["n_stream"], info["n_layer"], info["v_trans"]) == (n, 1, 30, False)
    assert set(info["k_types"]) == {"f16"} and set(info["v_types"]) == {"f16"} and info["splittable"]
    # A whole state (chunks and tail) restores into the same server: nothing left to compute but one token.
    split = split_state(state, CHUNK, tail=True)
    assert split.tail is not None
    restore(srv, 0, assemble_state([*split.chunks, split.tail], split.tokens, v_trans=False))
    again = complete(srv, 0)
    assert again["timings"]["prompt_n"] == 1 and again["content"] == run["content"]


def test_prefix_into_four_streams(pool: ServerPool) -> None:
    """-fa on, one stream -> -np 4 (n_stream 4), slot 2."""
    assert_same_run(move_prefix(pool.get("fa"), 0, pool.get("np4"), 2, v_trans=False))


def test_prefix_from_stream_two(pool: ServerPool) -> None:
    """A save of slot 2 of an n_stream=4 server (streams 0, 1, 3 empty) -> a one-stream server."""
    np4 = pool.get("np4")
    fresh_complete(np4, 2)
    state = parse_state(save(np4, 2))
    assert state.n_stream == 4 and [s.n_cells > 0 for s in state.caches[0].streams] == [False, False, True, False]
    assert_same_run(move_prefix(np4, 2, pool.get("fa"), 0, v_trans=False))


def test_across_v_layouts(pool: ServerPool, record_property: Any) -> None:
    """Rows (flash attention) -> transposed (no flash attention) and back; kernels differ, so the
    first tokens' top-5 probabilities are compared with recompute on the target."""
    fa, nofa = pool.get("fa"), pool.get("nofa")
    observed = {}
    for name, src, dst, v_trans in (("fa->nofa", fa, nofa, True), ("nofa->fa", nofa, fa, False)):
        m = move_prefix(src, 0, dst, 0, v_trans=v_trans, n_probs=5)
        assert m.source is not None
        assert m.restored["timings"]["prompt_n"] == m.reference["timings"]["prompt_n"] - m.n_restored
        diff = top_prob_diff(m.reference, m.restored)
        observed[name] = {
            "max_top5_prob_diff": round(diff, 4),
            "full_recompute_fa_vs_nofa_diff": round(top_prob_diff(m.reference, m.source), 4),
            "same_tokens": m.restored["tokens"] == m.reference["tokens"],
            "restored_tokens": m.n_restored, "suffix": m.restored["timings"]["prompt_n"],
        }
        assert diff < PROB_TOLERANCE, observed
    record_property("across_layouts", observed)
    print("across V layouts:", json.dumps(observed))


def test_unified_kv_transposed(pool: ServerPool) -> None:
    """-fa off one stream -> -np 4 --kv-unified (n_stream 1, slot 3), and slot 3's save back."""
    nofa, unified = pool.get("nofa"), pool.get("unified")
    assert_same_run(move_prefix(nofa, 0, unified, 3, v_trans=True))
    state = parse_state(save(unified, 3))
    assert state.n_stream == 1 and set(state.cell_streams()[0].seq_ids.tolist()) == {3} and state.v_trans
    assert_same_run(move_prefix(unified, 3, nofa, 0, v_trans=True))


def test_quantized_kv(pool: ServerPool, tmp_path: Path) -> None:
    """-ctk q8_0 -ctv q8_0 (needs -fa on): rows split and assemble; transposing is refused."""
    q8 = pool.get("q8")
    assert_same_run(move_prefix(q8, 0, q8, 0, v_trans=False))
    state = parse_state(save(q8, 0))
    assert state.layout is not None
    assert {la.k_type for la in state.layout.layers} == {8} and state.layout.layers[0].k_row_size == 204
    split = split_state(state, CHUNK)
    with pytest.raises(StateFormatError, match="q8_0 cannot be transposed"):
        assemble_state(split.chunks[:2], split.tokens, v_trans=True)
    ident = identity(smollm2_path(), tmp_path)
    f16 = layout_fingerprint(ident, parse_state(_saved(pool, "unified", 3)))
    assert layout_fingerprint(ident, state) != f16


def _saved(pool: ServerPool, name: str, slot: int) -> bytes:
    srv = pool.running.get(name)
    path = (srv.slot_dir if srv else pool.root / f"slots-{name}") / "saved.bin"
    return path.read_bytes()


def test_generated_model(pool: ServerPool, random_model: str, tmp_path: Path) -> None:
    """A ggufgen model (3 layers, GQA 4:1, head size 128) restores, and gets another fingerprint."""
    srv = pool.get("random")
    assert_same_run(move_prefix(srv, 0, srv, 0, v_trans=True))
    state = parse_state(save(srv, 0))
    assert state.layout is not None and state.layout.n_layer == 3
    assert state.cell_streams()[0].layers[0].n_embd_v_gqa == 256
    smol_state = parse_state(_saved(pool, "q8", 0))
    rand_id, smol_id = identity(random_model, tmp_path), identity(smollm2_path(), tmp_path)
    assert rand_id != smol_id
    fp_rand = layout_fingerprint(rand_id, state)
    assert fp_rand != layout_fingerprint(smol_id, smol_state)
    assert fp_rand != layout_fingerprint(smol_id, state)  # same layout, other model
    assert Namespace(fp_rand).id != Namespace(layout_fingerprint(smol_id, smol_state)).id
