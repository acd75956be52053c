"""A model's vocabulary loaded in-process, to tokenize prompts exactly as llama-server does.

llama-cpp-python (the ``llama`` extra, pinned to the llama.cpp llama-server is built from) loads
the GGUF with ``vocab_only``: metadata and vocabulary, no weights (~0.1 s, a few MB). Tokenizing
then calls the same ``llama_tokenize`` llama-server's completion endpoints call, with the same
flags (special tokens added and parsed), without an HTTP round trip.

For byte-level BPE vocabularies (most current models), a conversation's prompt is mostly text
seen before: llama.cpp first cuts a text at every special token (``<|im_start|>``...) and then
tokenizes each piece between them on its own (``tokenizer_st_partition`` in ``llama-vocab.cpp``).
kvtier makes the same cut and remembers the tokens of each piece, so a new turn costs the
tokenization of its new messages, not of the whole history (~1.6 us per token on a small CPU).

The remembered pieces are kept per *scope* (kvtier passes the tenant's salt): a text is found
only among the pieces tokenized for the same scope. Shared, a fast answer would tell one tenant
that another had sent the same text (a hit costs ~0.2 ms, tokenizing a few thousand characters
~3 ms), and the time a request takes is something any client measures.

A plain text prompt is a single piece that grows from request to request. For those, a piece that
shares its start with a remembered one reuses its tokens up to the last word boundary of what
they share (a space after a non-space, before a letter: byte-level BPE pre-tokenizers always split
there, and BPE never merges across a split) and tokenizes only the text after it. The token texts'
lengths locate the boundary in the remembered tokens; kvtier's start-up check and its after-request
check (against the tokens llama-server saved) stop in-process tokenizing if a vocabulary does not
behave so.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

CACHE_BYTES = 16 << 20  # text of the remembered pieces
EXTEND_MIN = 512  # pieces at least this long are tokenized from a remembered piece sharing their start
HEAD_BYTES = 64  # remembered pieces are found by their first bytes
BASES_PER_HEAD = 4  # the most recent pieces kept per start
MAX_HEADS = 256
BOUNDARY_SEARCH = 1024  # bytes searched back from a remembered piece's end for a word boundary
C_SPACE = b" \t\n\v\f\r"  # C isspace(), what llama.cpp strips beside LSTRIP/RSTRIP tokens


class VocabUnavailable(RuntimeError):
    """llama-cpp-python is not installed or the model file cannot be loaded."""


@dataclass(frozen=True, slots=True)
class MemoStats:
    """Bytes of text the piece cache served since the vocabulary was loaded, all scopes together."""

    hit_bytes: int  # pieces found whole
    extended_bytes: int  # reused from a remembered piece sharing their start
    tokenized_bytes: int  # given to llama.cpp


class Vocab:
    """The vocabulary of one GGUF; safe to use from several threads."""

    def __init__(self, path: str, cache_bytes: int = CACHE_BYTES):
        try:
            import llama_cpp
        except ImportError as exc:
            raise VocabUnavailable(f"llama-cpp-python is not installed ({exc})") from None
        # llama.cpp logs every loaded key to stderr unless its Python logger is set above INFO.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self._ll = llama_cpp
        _init_backend(llama_cpp)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise VocabUnavailable(f"llama.cpp could not load the vocabulary of {path}")
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self._token_p = ctypes.POINTER(llama_cpp.llama_token)
        self.path = path
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.add_eos = bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))
        self._bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        self._eos = int(llama_cpp.llama_vocab_eos(self._vocab))
        self._specials = self._special_tokens() if llama_cpp.llama_vocab_type(self._vocab) == \
            llama_cpp.LLAMA_VOCAB_TYPE_BPE else None
        self._text_len = self._token_text_lengths() if self._specials is not None else None
        # (scope, first bytes) -> recent long pieces; (scope, piece) -> its tokens
        self._bases: OrderedDict[tuple[str, bytes], deque[bytes]] = OrderedDict()
        self._pieces: OrderedDict[tuple[str, bytes], np.ndarray] = OrderedDict()
        self._hit_bytes = self._extended_bytes = self._tokenized_bytes = 0
        self._cached_bytes = 0
        self._cache_limit = cache_bytes
        self._cache_lock = threading.Lock()

    def _special_tokens(self) -> list[tuple[bytes, int, bool, bool]]:
        """(text, id, lstrip, rstrip) of every token llama.cpp cuts a text at, longest first."""
        ll = self._ll
        kinds = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_USER_DEFINED | ll.LLAMA_TOKEN_ATTR_UNKNOWN
        out = []
        for tid in range(ll.llama_vocab_n_tokens(self._vocab)):
            attr = ll.llama_vocab_get_attr(self._vocab, tid)
            if attr & kinds:
                text = ll.llama_vocab_get_text(self._vocab, tid) or b""
                if text:
                    out.append((bytes(text), tid, bool(attr & ll.LLAMA_TOKEN_ATTR_LSTRIP),
                                bool(attr & ll.LLAMA_TOKEN_ATTR_RSTRIP)))
        out.sort(key=lambda s: -len(s[0]))
        return out

    def _token_text_lengths(self) -> np.ndarray:
        """Bytes of text each token stands for (0 for control tokens)."""
        ll = self._ll
        n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        out = np.zeros(n_vocab, np.int64)
        buf = ctypes.create_string_buffer(256)
        for tid in range(n_vocab):
            n = ll.llama_token_to_piece(self._vocab, tid, buf, len(buf), 0, False)
            out[tid] = n if n >= 0 else -1  # longer than the buffer: never used as a boundary
        return out

    def tokenize(self, text: str, scope: str = "") -> np.ndarray:
        """Token ids of ``text`` as llama-server tokenizes a prompt (special tokens added and parsed).

        Args:
            scope: whose pieces may be reused (the tenant): a piece is remembered for its scope only.

        Raises UnicodeEncodeError on lone surrogates.
        """
        data = text.encode("utf-8")
        if self._specials is None:
            return self._tokenize_bytes(data, True)
        out: list[np.ndarray] = []
        if self.add_bos:
            out.append(np.array([self._bos], np.int32))
        for piece in self._partition(data):
            out.append(np.array([piece], np.int32) if isinstance(piece, int) else self._piece_tokens(scope, piece))
        if self.add_eos:
            out.append(np.array([self._eos], np.int32))
        return np.concatenate(out) if out else np.zeros(0, np.int32)

    def tokenize_whole(self, text: str) -> np.ndarray:
        """``tokenize`` without the piece cache: one llama.cpp call, safe in any thread."""
        return self._tokenize_bytes(text.encode("utf-8"), True)

    def _partition(self, data: bytes) -> list[bytes | int]:
        """llama.cpp's cut of ``data`` at special tokens: text pieces and token ids, in order."""
        pieces: list[bytes | int] = [data] if data else []
        assert self._specials is not None
        for special, tid, lstrip, rstrip in self._specials:
            if special not in data:
                continue
            cut: list[bytes | int] = []
            for piece in pieces:
                if isinstance(piece, int):
                    cut.append(piece)
                    continue
                start = 0
                while (match := piece.find(special, start)) >= 0:
                    left = piece[start:match]
                    if lstrip:
                        left = left.rstrip(C_SPACE)
                    if left:
                        cut.append(left)
                    cut.append(tid)
                    start = match + len(special)
                    if rstrip:
                        while start < len(piece) and piece[start] in C_SPACE:
                            start += 1
                if start < len(piece):
                    cut.append(piece[start:])
            pieces = cut
        return pieces

    def _piece_tokens(self, scope: str, piece: bytes) -> np.ndarray:
        key = (scope, piece)
        with self._cache_lock:
            tokens = self._pieces.get(key)
            if tokens is not None:
                self._pieces.move_to_end(key)
                self._hit_bytes += len(piece)
                return tokens
        long = len(piece) >= EXTEND_MIN
        extended = self._extend(scope, piece) if long else None
        tokens = extended if extended is not None else self._tokenize_bytes(piece, False)
        with self._cache_lock:
            if extended is None:
                self._tokenized_bytes += len(piece)
            if len(piece) <= self._cache_limit // 4 and key not in self._pieces:
                self._pieces[key] = tokens
                self._cached_bytes += len(piece)
                if long:
                    self._remember_base(scope, piece)
            while self._cached_bytes > self._cache_limit:
                (old_scope, old), _ = self._pieces.popitem(last=False)
                self._cached_bytes -= len(old)
                self._forget_base(old_scope, old)
        return tokens

    def _remember_base(self, scope: str, piece: bytes) -> None:
        head = (scope, piece[:HEAD_BYTES])
        bases = self._bases.get(head)
        if bases is None:
            bases = self._bases[head] = deque(maxlen=BASES_PER_HEAD)
            if len(self._bases) > MAX_HEADS:
                self._bases.popitem(last=False)
        else:
            self._bases.move_to_end(head)
        bases.append(piece)

    def _forget_base(self, scope: str, piece: bytes) -> None:
        """An evicted piece is no start for others (nor kept alive outside the cache's budget)."""
        bases = self._bases.get((scope, piece[:HEAD_BYTES])) if len(piece) >= EXTEND_MIN else None
        if bases is not None and piece in bases:
            bases.remove(piece)

    def _extend(self, scope: str, piece: bytes) -> np.ndarray | None:
        """``piece``'s tokens from the remembered piece of ``scope`` that shares the longest start
        with it, or None."""
        assert self._text_len is not None
        base, shared, base_tokens = b"", 0, None
        with self._cache_lock:
            for candidate in self._bases.get((scope, piece[:HEAD_BYTES]), ()):
                tokens = self._pieces.get((scope, candidate))
                n = common_prefix(piece, candidate)
                if tokens is not None and n > shared:
                    base, shared, base_tokens = candidate, n, tokens
        # Before the first differing byte: the space must be there in both texts.
        cut = word_boundary(piece, shared - 1)
        if base_tokens is None or cut <= 0:
            return None
        ends = np.cumsum(self._text_len[base_tokens])
        at = int(np.searchsorted(ends, cut))
        if ends[-1] != len(base) or at >= ends.size or ends[at] != cut:
            return None  # the tokens' texts do not line up with the piece: tokenize it whole
        with self._cache_lock:
            self._extended_bytes += cut
            self._tokenized_bytes += len(piece) - cut
        return np.concatenate([base_tokens[: at + 1], self._tokenize_bytes(piece[cut:], False)])

    def memo_stats(self) -> MemoStats:
        with self._cache_lock:
            return MemoStats(self._hit_bytes, self._extended_bytes, self._tokenized_bytes)

    def _tokenize_bytes(self, data: bytes, add_special: bool) -> np.ndarray:
        if self._model is None:
            raise VocabUnavailable("vocabulary closed")
        # Never more tokens than bytes, plus BOS/EOS: one call almost always suffices.
        out = np.empty(len(data) + 2, np.int32)
        n = self._ll.llama_tokenize(self._vocab, data, len(data), out.ctypes.data_as(self._token_p), out.size,
                                    add_special, True)
        if n < 0:
            out = np.empty(-n, np.int32)
            n = self._ll.llama_tokenize(self._vocab, data, len(data), out.ctypes.data_as(self._token_p), out.size,
                                        add_special, True)
            if n < 0:
                raise RuntimeError("llama_tokenize failed")
        return out[:n].copy()

    def close(self) -> None:
        if self._model is not None:
            self._ll.llama_model_free(self._model)
            self._model = None
        with self._cache_lock:
            self._pieces.clear()
            self._bases.clear()
            self._cached_bytes = 0


def common_prefix(a: bytes, b: bytes) -> int:
    """How many leading bytes ``a`` and ``b`` share (a binary search of memcmp's)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def word_boundary(data: bytes, end: int) -> int:
    """The last offset ``k <= end`` where ``data[k]`` is a space between a non-space and an ASCII
    letter (searched ``BOUNDARY_SEARCH`` bytes back), or -1."""
    lo = max(end - BOUNDARY_SEARCH, 1)
    k = min(end, len(data) - 2)
    while k >= lo:
        k = data.rfind(b" ", lo, k + 1)
        if k < lo:
            return -1
        if data[k - 1] not in C_SPACE and data[k + 1:k + 2].isalpha():
            return k
        k -= 1
    return -1


_backend_lock = threading.Lock()
_backend_ready = False


def _init_backend(llama_cpp: object) -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_backend_init()  # type: ignore[attr-defined]
            _backend_ready = True
