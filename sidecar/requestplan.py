"""One request's cache work, as ``KVEngine.prepare`` plans it and ``Aftercare`` finishes it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiers.keys import Namespace
from tiers.sessions import Manifest
from tiers.store import FetchResult

from .asked import Asked
from .prompts import Prompt
from .restorer import Restored
from .slots import Lease

NO_TOKENS = np.zeros(0, np.int32)
NO_TOKENS.flags.writeable = False


@dataclass(slots=True)
class RequestPlan:
    """One request's cache work: its tokens, its slot, and what was restored."""

    tokens: np.ndarray
    lease: Lease
    namespace: Namespace
    salt: str = ""
    session_id: str | None = None
    prompt: Prompt | None = None  # checked against the tokens llama-server saves
    restored_tokens: int = 0
    restore_tier: str = ""
    restore_ms: float = 0.0
    overhead_ms: float = 0.0
    fetched: FetchResult | None = None  # promoted into the local tiers after the answer
    asked: Asked = ()  # what the request asked, remembered with its slot (follow-ups)
    follow_up: bool = False  # sent to the slot holding what it continues, without tokens
    # A follow-up's: seconds from the end of the answer it continues to its arrival (an agent's tool call).
    step_gap: float | None = None
    # A session restored for this request: the save after the answer records its use (a touch
    # when there is none), so the restore does not wait for a manifest write.
    restored_session: Manifest | None = None
    # The llama-server identity it was planned in (``ServerWatcher.generation``): a slot read after
    # another process answers there is not stored.
    generation: int = 0
    sharing: int = 0  # other slots computing when it got its slot (the prefill rate is learned by it)
    # Tokens llama-server would reuse without a restore: the slot's, or its own prompt cache's (``llamacache``).
    llama_reused: int = 0

    @property
    def to_compute(self) -> int:
        """Prompt tokens llama-server computes: those neither restored nor reused."""
        return int(self.tokens.size) - max(self.restored_tokens, self.lease.cached_tokens, self.llama_reused)

    def took(self, restored: Restored) -> None:
        self.restored_tokens, self.restore_tier, self.restore_ms = restored.n_tokens, restored.tier, restored.ms
