"""What kind of memory a llama.cpp context keeps, and the lookup shape that follows from it.

llama.cpp writes one of four memory states into a sequence-state file (``llama-memory-*.cpp``):

    kv         one KV cache: every token's K/V, cut into prefix chunks and restored by any prefix
    kv_pair    two KV caches (sliding-window attention: the full cache, then the window's)
    hybrid     one or two KV caches, then a recurrent state
    recurrent  a recurrent state alone (Mamba, RWKV): no K/V per token

A state with a *rest* (all but ``kv``) holds part of the sequence's recent past only, so it is
restored whole: its first KV cache is chunked, and its tail carries the rest (``integrations.chunks``).
Recurrent memory alone is one tail of every token. ``opaque`` is a memory the parser could not read.

The kind is derived once, where the state or the context is first read, and every flow branches on
it here, in one place each: ``MemoryKind.has_rest``/``tail_only`` and ``LookupShape``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MemoryKind(enum.StrEnum):
    """A context's memory, as its state files show it (a ``str``: it is written into JSON and logs)."""

    KV = "kv"
    KV_PAIR = "kv_pair"
    HYBRID = "hybrid"
    RECURRENT = "recurrent"
    OPAQUE = "opaque"

    @property
    def has_rest(self) -> bool:
        """States carry a rest after the first KV cache, or are one: restored whole, never as a
        shorter prefix."""
        return self in (MemoryKind.KV_PAIR, MemoryKind.HYBRID, MemoryKind.RECURRENT)

    @property
    def tail_only(self) -> bool:
        """Recurrent memory alone: each state is one tail of every token, no chunk."""
        return self is MemoryKind.RECURRENT

    @property
    def label(self) -> str:
        """How ``kvtier`` names it to an operator (logs, ``/health``)."""
        return _LABELS[self]


_LABELS = {
    MemoryKind.KV: "one KV cache",
    MemoryKind.KV_PAIR: "KV cache + sliding window (restored whole)",
    MemoryKind.HYBRID: "KV cache + recurrent state (restored whole)",
    MemoryKind.RECURRENT: "recurrent state alone (restored whole, one tail per state)",
    MemoryKind.OPAQUE: "a memory state kvtier cannot read (not stored)",
}


@dataclass(frozen=True, slots=True)
class LookupShape:
    """How a prompt's prefix is looked up in the tiers for one context (``kvflow.find_prefix``).

    ``n_ctx``: the slot's context (a restore leaves room to compute at least one token; 0: no
    limit). ``kind``: the context's memory, which decides whether a prefix without its tail is
    usable (``whole``) and whether there are chunks at all (``tail_only``).
    """

    n_ctx: int = 0
    kind: MemoryKind = MemoryKind.KV

    @property
    def whole(self) -> bool:
        return self.kind.has_rest

    @property
    def tail_only(self) -> bool:
        return self.kind.tail_only


PLAIN_KV = LookupShape()  # one KV cache, no context limit
