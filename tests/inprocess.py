"""In-process llama-cpp-python contexts for the tests."""

from __future__ import annotations

from typing import Any

import llama_cpp


def counting_llama(model: str) -> llama_cpp.Llama:
    """A ``Llama`` (2 threads, batch 512) whose ``evals`` list the token counts handed to ``eval``."""
    llm = llama_cpp.Llama(model, n_ctx=2048, n_threads=2, n_batch=512, seed=7, verbose=False)
    evals: list[int] = []
    original = llm.eval

    def counting_eval(tokens: Any) -> None:
        evals.append(len(tokens))
        original(tokens)

    llm.eval = counting_eval  # type: ignore[method-assign]
    llm.evals = evals  # type: ignore[attr-defined]
    return llm
