"""A sliding-window model's slot, saved on one llama-server, is reused by another: the A -> B hop.

Gemma 3 270M (real weights, ``n_swa`` 512) answers a ~1,440-token chat turn on server A, whose
slot is saved and restored on a fresh server B with the same flags; the next turn (the chat, its
answer and a new question) then goes to B and to A, which kept its slot. On default flags the
saved window is written back two masked cells longer (``integrations.swa.pad_swa_window``), or
llama-server throws it away (``cache_n`` 0, measured below); with ``--swa-full`` the saved file
is restored as it is. Either way B computes only the new turn's tokens, as A does, and answers
with A's greedy tokens (same flags, threads and batch sizes; the same cached/computed boundary).
A generated gemma3 with a 32-token window checks the padded bytes, for both V layouts.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from integrations.memkind import MemoryKind
from integrations.stateparse import parse_state
from integrations.statewrite import write_state
from integrations.swa import gguf_sliding_window, pad_swa_window, swa_padding, swa_window
from tests.ggufgen import ModelShape, write_random_model
from tests.servers import gemma3_path, llama_server, smollm2_path
from tiers.errors import StateFormatError

pytestmark = pytest.mark.llama

N_SWA = 512  # Gemma 3 270M's sliding window, in tokens
N_ANSWER = 32  # turn 1's answer
N_NEXT = 16  # turn 2's answer
TOPICS = ("rivers", "mountains", "bridges", "libraries", "orchards", "harbors", "railways", "deserts",
          "glaciers", "markets", "lighthouses", "forests", "canals", "observatories", "vineyards")
FLAGS = {"default": (), "swa-full": ("--swa-full",)}


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def notes(n: int) -> str:
    """A long user message (~34 tokens a note) that asks about its own content."""
    return " ".join(f"Note {i}: the {TOPICS[i % len(TOPICS)]} of region {i * 7 % 31} were surveyed in year "
                    f"{1800 + i * 3}, and the report lists {i * 13 % 97} sites worth a visit." for i in range(n))


@dataclass(frozen=True, slots=True)
class Turn:
    cache_n: int
    prompt_n: int
    ids: list[int]  # the greedy tokens
    content: str


def chat(url: str, messages: Sequence[dict[str, str]], n: int) -> Turn:
    res = post(url + "/v1/chat/completions", {"messages": list(messages), "max_tokens": n, "temperature": 0,
                                              "id_slot": 0, "cache_prompt": True, "logprobs": True,
                                              "top_logprobs": 1})
    choice, t = res["choices"][0], res["timings"]
    return Turn(t["cache_n"], t["prompt_n"], [c["id"] for c in choice["logprobs"]["content"]],
                choice["message"]["content"])


@dataclass(frozen=True, slots=True)
class Saved:
    flags: tuple[str, ...]
    state: bytes  # A's slot after turn 1
    next_turn: list[dict[str, str]]  # turn 2's messages
    on_a: Turn  # turn 2 on A, which kept its slot


@pytest.fixture(scope="module", params=list(FLAGS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    """Turn 1 on A, A's slot saved, then turn 2 on A; A stops before B starts (2-core machines)."""
    flags = FLAGS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    user = notes(42) + "\nWhich note mentions lighthouses first? Answer briefly."
    with llama_server(tmp, *flags, model=gemma3_path()) as a:
        first = chat(a.url, [{"role": "user", "content": user}], N_ANSWER)
        assert first.cache_n == 0 and first.prompt_n > N_SWA  # the window is full, and cut
        post(a.url + "/slots/0?action=save", {"filename": "a.bin"})
        state = (a.slot_dir / "a.bin").read_bytes()
        next_turn = [{"role": "user", "content": user}, {"role": "assistant", "content": first.content},
                     {"role": "user", "content": "And which note mentions canals first?"}]
        on_a = chat(a.url, next_turn, N_NEXT)
    yield Saved(flags, state, next_turn, on_a)


def restored(tmp: Path, saved: Saved, state: bytes, prompt: list[int] | None = None) -> Turn:
    """Turn 2 (or ``prompt``'s tokens, 4 predicted) on a fresh server B after restoring ``state``."""
    with llama_server(tmp, *saved.flags, model=gemma3_path()) as b:
        (b.slot_dir / "r.bin").write_bytes(state)
        res = post(b.url + "/slots/0?action=restore", {"filename": "r.bin"})
        assert res["n_restored"] == parse_state(state).n_tokens
        if prompt is None:
            return chat(b.url, saved.next_turn, N_NEXT)
        done = post(b.url + "/completion", {"prompt": prompt, "n_predict": 4, "temperature": 0,
                                            "id_slot": 0, "cache_prompt": True})
        return Turn(done["timings"]["cache_n"], done["timings"]["prompt_n"], [], done["content"])


def test_window_size_is_read_from_the_gguf() -> None:
    assert gguf_sliding_window(gemma3_path()) == N_SWA
    assert gguf_sliding_window(smollm2_path()) == 0  # no sliding window


def test_the_saved_window_holds_n_swa_cells(saved: Saved) -> None:
    # llama_kv_cache::state_write leaves out the cells the window masks, --swa-full or not.
    st = parse_state(saved.state)
    base, window = st.cell_streams()
    assert base.n_cells == st.n_tokens and int(base.pos.min()) == 0
    assert window.n_cells == N_SWA and int(window.pos.min()) == st.n_tokens - N_SWA


def test_a_restore_is_reused_like_the_kept_slot(saved: Saved, tmp_path: Path) -> None:
    st = parse_state(saved.state)
    # Default flags: llama-server keeps a prefix only while the window's lowest position is below
    # pos_next - n_swa, one cell below what the saved window holds. --swa-full: n_swa is 0 there.
    state = saved.state if saved.flags else bytes(pad_swa_window(st, gguf_sliding_window(gemma3_path())))
    on_b = restored(tmp_path, saved, state)
    assert saved.on_a.cache_n == st.n_tokens  # A reuses its own slot...
    assert (on_b.cache_n, on_b.prompt_n) == (st.n_tokens, saved.on_a.prompt_n)  # ...and B the restore
    assert on_b.prompt_n < 64  # the new turn only
    assert on_b.ids == saved.on_a.ids


@pytest.mark.parametrize("saved", ["default"], indirect=True)
def test_the_saved_window_alone_is_recomputed_on_default_flags(saved: Saved, tmp_path: Path) -> None:
    on_b = restored(tmp_path, saved, saved.state)
    assert on_b.cache_n == 0 and on_b.prompt_n == saved.on_a.cache_n + saved.on_a.prompt_n


@pytest.mark.parametrize("saved", ["default"], indirect=True)
def test_the_saved_tokens_alone_need_the_second_cell(saved: Saved, tmp_path: Path) -> None:
    # A prompt with no new token: llama-server recomputes the last one, and its threshold is one lower.
    st = parse_state(saved.state)
    prompt = [int(t) for t in st.tokens.tokens]
    one = restored(tmp_path, saved, bytes(pad_swa_window(st, N_SWA, cells=1)), prompt)
    two = restored(tmp_path, saved, bytes(pad_swa_window(st, N_SWA)), prompt)
    assert (one.cache_n, one.prompt_n) == (0, st.n_tokens)
    assert (two.cache_n, two.prompt_n) == (st.n_tokens - 1, 1)


# -- the padded bytes, on a generated model -------------------------------------------------------

WINDOW = 32  # the generated gemma3's window
SHAPE = ModelShape(sliding_window=WINDOW, swa_pattern=2)  # layers 0, 2 sliding, 1, 3 full


@pytest.fixture(scope="module", params=["on", "off"], ids=["v-rows", "v-transposed"])
def generated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Slot files of a generated gemma3: short (window not cut) and long, with A's next completion.

    ``-fa off`` stores V transposed; flash attention stores V rows."""
    tmp = tmp_path_factory.mktemp("gemma3")
    model = str(write_random_model(tmp / "gemma3.gguf", smollm2_path(), SHAPE, arch="gemma3", seed=11))
    prompt = list(range(1000, 1080))
    with llama_server(tmp, "-c", "1024", "-fa", request.param, model=model) as a:
        def run(tokens: list[int]) -> dict[str, Any]:
            return post(a.url + "/completion", {"prompt": tokens, "n_predict": 8, "temperature": 0,
                                                "id_slot": 0, "cache_prompt": True, "return_tokens": True})

        def save(name: str) -> bytes:
            post(a.url + "/slots/0?action=save", {"filename": name})
            return (a.slot_dir / name).read_bytes()

        run(prompt[:20])
        short = save("short.bin")
        run(prompt)
        long = save("long.bin")
        next_prompt = [int(t) for t in parse_state(long).tokens.tokens] + list(range(2000, 2010))
        yield {"model": model, "fa": request.param, "short": short, "long": long, "next": next_prompt,
               "on_a": run(next_prompt), "tmp": tmp}


def test_generated_window_size(generated: dict[str, Any]) -> None:
    assert gguf_sliding_window(generated["model"]) == WINDOW


def test_padding_adds_masked_zero_cells_below_the_window(generated: dict[str, Any]) -> None:
    st = parse_state(generated["long"])
    window = swa_window(st)
    assert window.v_trans == (generated["fa"] == "off")
    padded = parse_state(pad_swa_window(st, WINDOW))
    assert bytes(write_state(padded)) == bytes(pad_swa_window(st, WINDOW))  # a file the parser reads back
    assert np.array_equal(padded.tokens.words, st.tokens.words)
    full_attention = [dataclasses.replace(x, memory_kind=MemoryKind.KV, caches=x.caches[:1]) for x in (st, padded)]
    assert bytes(write_state(full_attention[0])) == bytes(write_state(full_attention[1]))
    pw = swa_window(padded)
    pos_min = int(window.pos.min())
    assert pw.n_cells == WINDOW + 2
    assert pw.pos[:2].tolist() == [pos_min - 2, pos_min - 1] and np.array_equal(pw.pos[2:], window.pos)
    assert np.all(pw.seq_ids == window.seq_ids[0])
    for old, new in zip(window.layers, pw.layers, strict=True):
        assert not new.k[:2].any() and np.array_equal(new.k[2:], old.k)
        if pw.v_trans:
            el = old.v_el_size
            assert not new.v[:, : 2 * el].any() and np.array_equal(new.v[:, 2 * el :], old.v)
        else:
            assert not new.v[:2].any() and np.array_equal(new.v[2:], old.v)


def test_a_window_that_is_not_cut_is_written_back_as_it_was(generated: dict[str, Any]) -> None:
    st = parse_state(generated["short"])
    assert swa_padding(st, WINDOW) == 0
    assert bytes(pad_swa_window(st, WINDOW)) == generated["short"]


def test_a_wrong_window_size_is_refused(generated: dict[str, Any]) -> None:
    st = parse_state(generated["long"])
    with pytest.raises(StateFormatError, match="holds 32 cells, n_swa is 64"):
        pad_swa_window(st, 2 * WINDOW)
    with pytest.raises(ValueError):
        pad_swa_window(st, 0)
    with pytest.raises(StateFormatError, match="not a sliding-window state"):
        pad_swa_window(dataclasses.replace(st, memory_kind=MemoryKind.KV, caches=st.caches[:1]), WINDOW)


def test_generated_padded_restore_is_reused(generated: dict[str, Any], tmp_path: Path) -> None:
    st = parse_state(generated["long"])
    on_a = generated["on_a"]
    with llama_server(tmp_path, "-c", "1024", "-fa", generated["fa"], model=generated["model"]) as b:
        (b.slot_dir / "r.bin").write_bytes(bytes(pad_swa_window(st, WINDOW)))
        post(b.url + "/slots/0?action=restore", {"filename": "r.bin"})
        on_b = post(b.url + "/completion", {"prompt": generated["next"], "n_predict": 8, "temperature": 0,
                                            "id_slot": 0, "cache_prompt": True, "return_tokens": True})
    assert on_a["timings"]["cache_n"] == on_b["timings"]["cache_n"] == st.n_tokens
    assert on_b["timings"]["prompt_n"] == on_a["timings"]["prompt_n"] == 10
    assert on_b["tokens"] == on_a["tokens"]
