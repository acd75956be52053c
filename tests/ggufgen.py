"""Random-weight llama-architecture GGUF models, for fast tests and KV shapes SmolLM2 lacks.

The tokenizer (every ``tokenizer.*`` key) is copied from a real model (SmolLM2 by default in the
tests), so llama-server can tokenize, template and detokenize; the weights are seeded random f16
(norms f32), so greedy output is gibberish but deterministic. Shapes are free: layer count, GQA
ratio (``n_head / n_head_kv``), head size and width, which is what the state codec cares about.

Needs the ``gguf`` package (a test dependency): ``python -m tests.ggufgen OUT --like MODEL``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TokenizerEdit = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Hyperparameters of a generated model (defaults: tiny, 4 layers, GQA 2:1, head size 64)."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512
    n_ctx_train: int = 8192
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_head_kv * self.head_dim

    def check(self) -> None:
        if min(self.n_layer, self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_ff) <= 0:
            raise ValueError("every dimension must be positive")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} must be a multiple of n_head_kv {self.n_head_kv}")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")


def _copy_tokenizer(writer: object, reader: object, edit: TokenizerEdit | None = None) -> int:
    import gguf

    assert isinstance(writer, gguf.GGUFWriter) and isinstance(reader, gguf.GGUFReader)
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:  # bytes as stored: tokens need not be valid UTF-8
                val: object = [bytes(field.parts[i]) for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(key, edit(key, val) if edit else val, main, sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                vocab = len(field.data)
        else:
            val = (bytes(field.parts[field.data[0]]) if main == gguf.GGUFValueType.STRING
                   else field.parts[field.data[0]].tolist()[0])
            writer.add_key_value(key, edit(key, val) if edit else val, main)
    if not vocab:
        raise ValueError("the tokenizer source has no tokenizer.ggml.tokens")
    return vocab


def write_random_llama(
    path: str | Path, tokenizer_from: str | Path, shape: ModelShape = ModelShape(), *, seed: int = 0,
    name: str = "kvtier-random", edit_tokenizer: TokenizerEdit | None = None,
) -> Path:
    """Write a random-weight llama GGUF to ``path``.

    Args:
        path: output file.
        tokenizer_from: a GGUF whose ``tokenizer.*`` metadata is copied (vocabulary size follows it).
        shape: the model's hyperparameters.
        seed: weights seed; the same seed and shape give a byte-identical file.
        name: ``general.name``.
        edit_tokenizer: ``(key, value) -> value`` applied to each copied ``tokenizer.*`` value
            (strings as bytes): a vocabulary that tokenizes some text differently.

    Returns:
        ``path``.
    """
    import gguf

    shape.check()
    path = Path(path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name(name)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = _copy_tokenizer(writer, gguf.GGUFReader(str(tokenizer_from)), edit_tokenizer)
    writer.add_vocab_size(n_vocab)

    def weight(rows: int, cols: int) -> np.ndarray:
        # numpy (rows, cols) is ggml ne = (cols, rows): a matmul maps cols inputs to rows outputs.
        w: np.ndarray = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(1.0 / np.sqrt(cols))
        return w.astype(np.float16)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    e, q, kv = shape.n_embd, shape.n_head * shape.head_dim, shape.n_embd_k_gqa
    writer.add_tensor("token_embd.weight", weight(n_vocab, e))
    writer.add_tensor("output_norm.weight", norm(e))
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        writer.add_tensor(p + "attn_norm.weight", norm(e))
        writer.add_tensor(p + "attn_q.weight", weight(q, e))
        writer.add_tensor(p + "attn_k.weight", weight(kv, e))
        writer.add_tensor(p + "attn_v.weight", weight(kv, e))
        writer.add_tensor(p + "attn_output.weight", weight(e, q))
        writer.add_tensor(p + "ffn_norm.weight", norm(e))
        writer.add_tensor(p + "ffn_gate.weight", weight(shape.n_ff, e))
        writer.add_tensor(p + "ffn_up.weight", weight(shape.n_ff, e))
        writer.add_tensor(p + "ffn_down.weight", weight(e, shape.n_ff))
    # No output.weight: llama ties the output to token_embd when it is absent.
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.ggufgen", description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--like", required=True, help="GGUF to copy the tokenizer from")
    for f in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(ModelShape(), f))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    shape = ModelShape(a.n_layer, a.n_embd, a.n_head, a.n_head_kv, a.head_dim, a.n_ff)
    print(write_random_llama(a.out, a.like, shape, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
