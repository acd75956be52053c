"""Limits on what a completion body may hold, checked before kvtier (or llama-server) acts on it.

Two kinds, both answered 400 with what was over which setting:

- **Shape** (``shape_problem``), read from the body's bytes before it is parsed. Parsed, a body
  costs far more than its size: orjson builds a Python object per value, 8 bytes for ``null``
  or ``0`` (shared objects, a list slot each) up to 72 bytes for an empty object and 184 for an
  object with one key, so a 31 MB list of ``{}`` becomes 744 MB. Counting the values first
  bounds that whatever the body holds (``max_json_values``), and the same scan bounds its
  nesting (``max_json_depth``): kvtier re-encodes bodies with orjson, which writes 254 levels at most.
- **Grammars** (``grammar_problem``), read from the parsed body: llama-server's GBNF parser
  recurses once per nested group and crashed (segmentation fault, the whole server down) at
  20,000 nested ``(`` (llama.cpp #26600). ``grammar`` is bounded in size and group nesting; a
  JSON schema (``json_schema``, ``response_format``, ``tools``) by ``max_json_depth`` with the
  rest of the body.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

_WINDOW = 256 << 10  # bytes scanned at a time: bounds the scan's own arrays (~8 bytes per structural byte)
_QUOTE, _BACKSLASH = 0x22, 0x5C
# Per byte (a bytes.translate table, faster than numpy's indexing): 1 for what adds a value or
# key (, :), 2 for an opening bracket (a value that nests), 3 for a closing one; 0 for the rest.
_CODES = bytes(1 if b in b",:" else 2 if b in b"[{" else 3 if b in b"]}" else 0 for b in range(256))
# GBNF's lexemes that may hold a parenthesis without opening a group: string literals, character
# classes (both with backslash escapes) and comments; and the parentheses themselves.
_GBNF_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\[[^\]\\]*(?:\\.[^\]\\]*)*\]|#[^\r\n]*|[()]', re.DOTALL)


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """What one completion body may hold; 0 turns a limit off."""

    max_values: int = 1_000_000  # values and object keys in the whole body
    max_depth: int = 128  # nesting of arrays and objects in the whole body
    max_grammar_chars: int = 1_000_000  # characters of a GBNF ``grammar``
    max_grammar_depth: int = 256  # groups nested in a ``grammar``: ``((...))`` is 2


@dataclass(frozen=True, slots=True)
class Shape:
    """What a JSON text holds, as counted from its bytes."""

    values: int  # values and object keys (an empty array or object counts twice)
    depth: int  # deepest nesting of arrays and objects


def shape_problem(raw: bytes, limits: BodyLimits) -> str | None:
    """Why ``raw`` holds more values or nests deeper than ``limits`` allow; None when it does not.

    Counted on the bytes, so nothing is built for a body that is refused: a first count over
    every byte (quoted text included) is an upper bound and usually settles it; only a body it
    does not settle is scanned with its strings told apart (numpy, a few ms per MB).
    """
    opens = raw.count(b"[") + raw.count(b"{")
    values = raw.count(b",") + raw.count(b":") + opens + 1
    if (not limits.max_values or values <= limits.max_values) and (not limits.max_depth or opens <= limits.max_depth):
        return None
    shape = json_shape(raw, stop_after=limits.max_values)
    if limits.max_values and shape.values > limits.max_values:
        return (f"request body holds over {limits.max_values} JSON values (max_json_values): more than a "
                f"completion needs")
    if limits.max_depth and shape.depth > limits.max_depth:
        return f"request body nests {shape.depth} levels deep, over the limit of {limits.max_depth} (max_json_depth)"
    return None


def json_shape(raw: bytes, stop_after: int = 0) -> Shape:
    """The values (and keys) and nesting depth of the JSON text ``raw``.

    Strings are told apart as a JSON parser does: a quote opens or closes one unless an odd run
    of backslashes precedes it. Past the first error of an invalid text the count may be off,
    but a parser stops there too. ``stop_after``: stop counting once past this many values.
    """
    data = np.frombuffer(raw, np.uint8)
    inside = 0  # 1 while the scan is within a string
    run = 0  # backslashes just before the window
    depth = deepest = 0
    values = 1  # the top-level value
    for start in range(0, len(data), _WINDOW):
        window = data[start:start + _WINDOW]
        quotes = np.flatnonzero(window == _QUOTE)
        if quotes.size and (run or raw.find(b"\\", start, start + _WINDOW) >= 0):
            quotes = quotes[~_escaped(window, quotes, run)]
        codes = np.frombuffer(raw[start:start + _WINDOW].translate(_CODES), np.uint8)
        where = np.flatnonzero(codes)
        outside = where[(np.searchsorted(quotes, where) + inside) % 2 == 0]
        kinds = codes[outside]
        values += int(np.count_nonzero(kinds < 3))
        brackets = kinds[kinds >= 2]
        if brackets.size:
            levels = np.cumsum(np.where(brackets == 2, 1, -1), dtype=np.int64) + depth
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
        inside = (inside + int(quotes.size)) % 2
        run = _trailing_backslashes(window, run)
        if stop_after and values > stop_after:
            break
    return Shape(values, deepest)


def _escaped(window: np.ndarray, quotes: np.ndarray, run: int) -> np.ndarray:
    """For each quote position in ``window``, whether an odd run of backslashes precedes it
    (``run`` of them end the window before)."""
    index = np.arange(window.size, dtype=np.int64)
    # The last byte at or before each position that is not a backslash (-1: none in the window).
    last_other = np.maximum.accumulate(np.where(window == _BACKSLASH, -1, index))
    before = np.where(quotes > 0, last_other[np.maximum(quotes - 1, 0)], -1)
    backslashes = quotes - 1 - before
    backslashes = np.where(before < 0, quotes + run, backslashes)  # the run reaches back into the last window
    return np.asarray(backslashes % 2 == 1)


def _trailing_backslashes(window: np.ndarray, run: int) -> int:
    others = np.flatnonzero(window != _BACKSLASH)
    if others.size == 0:
        return run + int(window.size)
    return int(window.size - 1 - others[-1])


def grammar_problem(body: Mapping[str, Any], limits: BodyLimits) -> str | None:
    """Why the body's GBNF ``grammar`` is over ``limits``; None when it is not (or there is none).

    llama-server parses a grammar before it runs the request, recursing once per nested group:
    20,000 nested groups overflowed its stack (llama.cpp #26600), 5,000 did not.
    """
    grammar = body.get("grammar")
    if not isinstance(grammar, str) or not grammar:
        return None
    if limits.max_grammar_chars and len(grammar) > limits.max_grammar_chars:
        return (f"grammar has {len(grammar)} characters, over the limit of {limits.max_grammar_chars} "
                f"(max_grammar_chars)")
    if limits.max_grammar_depth and grammar.count("(") > limits.max_grammar_depth:
        nested = grammar_depth(grammar)
        if nested > limits.max_grammar_depth:
            return (f"grammar nests {nested} groups deep, over the limit of {limits.max_grammar_depth} "
                    f"(max_grammar_depth)")
    return None


def grammar_depth(grammar: str) -> int:
    """The deepest nesting of parenthesised groups in a GBNF grammar (literals, character
    classes and comments skipped)."""
    depth = deepest = 0
    for match in _GBNF_TOKENS.finditer(grammar):
        token = match.group()
        if token == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif token == ")":
            depth = max(depth - 1, 0)
    return deepest
