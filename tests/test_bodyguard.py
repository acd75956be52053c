"""The body guard's counts on bytes agree with what a JSON parser builds (pure logic, no servers)."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest

from sidecar import bodyguard
from sidecar.bodyguard import BodyLimits, grammar_depth, grammar_problem, json_shape, shape_problem

# Characters that fool a naive count: quotes, backslashes, brackets, separators inside strings.
_TRICKY = ['a', '"', '\\', '[', ']', '{', '}', ',', ':', ' ', 'é', '\\"', '\\\\']


def _truth(value: Any, depth: int = 0) -> tuple[int, int]:
    """(values and keys, an empty container counted twice; deepest nesting) of a parsed value."""
    if isinstance(value, (list, dict)):
        items = list(value.values()) if isinstance(value, dict) else value
        count, deepest = 1 + len(value) * isinstance(value, dict) + (not value), depth + 1
        for item in items:
            n, d = _truth(item, depth + 1)
            count, deepest = count + n, max(deepest, d)
        return count, deepest
    return 1, depth


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 6 or roll < 0.4:
        text = "".join(rng.choice(_TRICKY) for _ in range(rng.randint(0, 8)))
        return rng.choice([1, None, True, 2.5, text])
    if roll < 0.7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {"".join(rng.choice(_TRICKY) for _ in range(rng.randint(0, 4))): _random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


@pytest.mark.parametrize("window", [1, 2, 3, 7, 64, 256 << 10])
def test_shape_of_random_json_matches_the_parsed_value(window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strings full of quotes, backslash runs and brackets, split across scan windows anywhere."""
    monkeypatch.setattr(bodyguard, "_WINDOW", window)
    rng = random.Random(window)
    for _ in range(300):
        value = _random_value(rng)
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        shape = json_shape(raw)
        assert (shape.values, shape.depth) == _truth(orjson.loads(raw)), raw


def test_shape_limits_refuse_junk_and_deep_bodies_and_pass_text_that_only_looks_like_them() -> None:
    limits = BodyLimits(max_values=1000, max_depth=10)
    assert shape_problem(b'{"junk": [' + b"{}," * 2000 + b"{}]}", limits) is not None
    assert "max_json_depth" in (shape_problem(b'{"x": ' + b"[" * 11 + b"]" * 11 + b"}", limits) or "")
    assert shape_problem(b'{"x": ' + b"[" * 9 + b"]" * 9 + b"}", limits) is None
    text = json.dumps({"prompt": "[{a: 1, b: [2, 3]}], " * 5000}).encode()  # brackets and commas in a string
    assert shape_problem(text, limits) is None
    assert shape_problem(b'{"junk": [' + b"{}," * 2000 + b"{}]}", BodyLimits(max_values=0, max_depth=10)) is None


def test_grammar_depth_skips_literals_classes_and_comments() -> None:
    grammar = 'root ::= "(" ( [(] | "\\"(" ( x ) ) # (((\nx ::= [^)\\]] "a"'
    assert grammar_depth(grammar) == 2
    assert grammar_depth("root ::= " + "(" * 300 + '"a"' + ")" * 300) == 300
    limits = BodyLimits(max_grammar_chars=100, max_grammar_depth=2)
    assert grammar_problem({"grammar": grammar}, limits) is None
    assert "max_grammar_depth" in (grammar_problem({"grammar": 'root ::= ((("a")))'}, limits) or "")
    assert "max_grammar_chars" in (grammar_problem({"grammar": "x" * 101}, limits) or "")
    assert grammar_problem({"grammar": 5}, limits) is None  # not a grammar kvtier reads: llama-server answers
