"""A hybrid model's slot (attention KV cache + recurrent state), saved on one llama-server, restored on another.

A generated lfm2 (``tests/ggufgen.py``: attention layers 1 and 3, short convolutions in 0 and 2)
completes a prompt on server A, whose slot is saved and restored on a fresh server B. llama-server
keeps a cached prefix only while the memory's lowest position is below ``pos_next`` (``n_swa`` is
0 for lfm2); a hybrid memory's lowest position is its recurrent state's, the saved sequence's last
position (``llama_memory_hybrid::seq_pos_min``). So a restore is reused when the next prompt
continues the whole saved sequence, and recomputed from scratch when it leaves it earlier, or
repeats it without a new token: a recurrent state cannot be rewound.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from integrations.stateparse import parse_state
from tests.ggufgen import ModelShape, write_random_model
from tests.servers import llama_server, smollm2_path

pytestmark = pytest.mark.llama

SHAPE = ModelShape(attn_layers=(1, 3), conv_kernel=4)
PROMPT = list(range(1000, 1080))  # token ids
NEW = list(range(2000, 2010))  # the next prompt's new tokens
FLAGS = ("-c", "1024")


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def complete(url: str, prompt: list[int]) -> dict[str, Any]:
    return post(url + "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0, "id_slot": 0,
                                      "cache_prompt": True, "return_tokens": True})


@dataclass(frozen=True, slots=True)
class Saved:
    model: str
    state: bytes
    tokens: list[int]  # the saved sequence
    on_a: dict[str, Any]  # A's answer to the saved sequence + NEW, from its own slot


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    tmp = tmp_path_factory.mktemp("lfm2")
    model = str(write_random_model(tmp / "lfm2.gguf", smollm2_path(), SHAPE, arch="lfm2", seed=11))
    with llama_server(tmp, *FLAGS, model=model) as a:
        complete(a.url, PROMPT)
        post(a.url + "/slots/0?action=save", {"filename": "a.bin"})
        state = (a.slot_dir / "a.bin").read_bytes()
        tokens = [int(t) for t in parse_state(state).tokens.tokens]
        yield Saved(model, state, tokens, complete(a.url, tokens + NEW))


def on_b(tmp: Path, saved: Saved, prompt: list[int]) -> dict[str, Any]:
    with llama_server(tmp, *FLAGS, model=saved.model) as b:
        (b.slot_dir / "r.bin").write_bytes(saved.state)
        assert post(b.url + "/slots/0?action=restore", {"filename": "r.bin"})["n_restored"] == len(saved.tokens)
        return complete(b.url, prompt)


def test_the_saved_state_is_hybrid_as_of_its_last_position(saved: Saved) -> None:
    st = parse_state(saved.state)
    assert st.memory_kind == "hybrid" and st.recurrent is not None
    assert st.recurrent.pos.tolist() == [len(saved.tokens) - 1]


def test_a_prompt_that_continues_the_saved_sequence_reuses_the_restore(saved: Saved, tmp_path: Path) -> None:
    res = on_b(tmp_path, saved, saved.tokens + NEW)
    assert saved.on_a["timings"]["cache_n"] == res["timings"]["cache_n"] == len(saved.tokens)
    assert saved.on_a["timings"]["prompt_n"] == res["timings"]["prompt_n"] == len(NEW)
    assert res["tokens"] == saved.on_a["tokens"]


@pytest.mark.parametrize("cut", [60, None], ids=["leaves-it-earlier", "repeats-it-alone"])
def test_any_other_prompt_recomputes_everything(saved: Saved, tmp_path: Path, cut: int | None) -> None:
    prompt = saved.tokens if cut is None else saved.tokens[:cut] + NEW
    res = on_b(tmp_path, saved, prompt)
    assert (res["timings"]["cache_n"], res["timings"]["prompt_n"]) == (0, len(prompt))
