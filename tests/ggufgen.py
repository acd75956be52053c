"""Random-weight GGUF models, for fast tests and memory layouts SmolLM2 lacks.

The tokenizer (every ``tokenizer.*`` key) is copied from a real model (SmolLM2 by default in the
tests), so llama-server can tokenize, template and detokenize; the weights are seeded random f16
(norms, convolutions and SSM parameters f32), so greedy output is gibberish but deterministic.
Shapes are free: layer count, GQA ratio (``n_head / n_head_kv``), head size and width, which is
what the state codec cares about.

Architectures (``ARCHS``), one per memory layout llama.cpp writes into a sequence state:

- ``llama``: one dense KV cache.
- ``gemma3`` with ``sliding_window``: two KV caches (``llama_kv_cache_iswa``: the full-attention
  layers' and the sliding-window layers'; every ``swa_pattern``-th layer has full attention).
- ``lfm2``: hybrid memory (``llama_memory_hybrid``): a KV cache for the ``attn_layers``, then
  the recurrent state of the short-convolution layers (conv rows only).
- ``mamba2``: recurrent memory only (``llama_memory_recurrent``): conv and SSM rows per layer.

The names and keys follow the pinned llama.cpp (``src/models/{arch}.cpp`` ``load_arch_hparams``
and ``load_arch_tensors``, ``src/llama-arch.cpp``). Needs the ``gguf`` package (a test
dependency): ``python -m tests.ggufgen OUT --like MODEL [--arch lfm2]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TokenizerEdit = Callable[[str, Any], Any]

ARCHS = ("llama", "gemma3", "lfm2", "mamba2")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Hyperparameters of a generated model (defaults: tiny, 4 layers, GQA 2:1, head size 64).

    The attention fields apply to the layers that have attention; the last five to one
    architecture each (ignored by the others).
    """

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512
    n_ctx_train: int = 8192
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    sliding_window: int = 0  # gemma3: window in tokens (0: every layer full attention, one KV cache)
    swa_pattern: int = 2  # gemma3: every swa_pattern-th layer has full attention
    attn_layers: tuple[int, ...] = (1, 3)  # lfm2: the attention layers (the others are short convolutions)
    conv_kernel: int = 4  # lfm2: shortconv.l_cache; mamba2: ssm.conv_kernel
    ssm_state: int = 16  # mamba2: ssm.state_size (d_state); d_inner is 2 * n_embd, n_head heads of it

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


class _Weights:
    """Seeded random tensors. numpy (rows, cols) is ggml ne = (cols, rows): a matmul maps cols
    inputs to rows outputs."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def matrix(self, rows: int, cols: int) -> np.ndarray:
        w: np.ndarray = self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(1.0 / np.sqrt(cols))
        return w.astype(np.float16)

    def norm(self, n: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def small(self, *shape: int) -> np.ndarray:
        """f32 values near zero (convolution kernels and biases: ggml_ssm_conv reads f32 only)."""
        return (0.1 * self.rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def _attention(w: _Weights, p: str, shape: ModelShape, add: Callable[[str, np.ndarray], None]) -> None:
    e, q, kv = shape.n_embd, shape.n_head * shape.head_dim, shape.n_embd_k_gqa
    add(p + "attn_q.weight", w.matrix(q, e))
    add(p + "attn_k.weight", w.matrix(kv, e))
    add(p + "attn_v.weight", w.matrix(kv, e))
    add(p + "attn_output.weight", w.matrix(e, q))


def _ffn(w: _Weights, p: str, shape: ModelShape, add: Callable[[str, np.ndarray], None]) -> None:
    add(p + "ffn_gate.weight", w.matrix(shape.n_ff, shape.n_embd))
    add(p + "ffn_up.weight", w.matrix(shape.n_ff, shape.n_embd))
    add(p + "ffn_down.weight", w.matrix(shape.n_embd, shape.n_ff))


def _llama(writer: Any, w: _Weights, shape: ModelShape, add: Callable[[str, np.ndarray], None]) -> None:
    e = shape.n_embd
    add("output_norm.weight", w.norm(e))
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", w.norm(e))
        _attention(w, p, shape, add)
        add(p + "ffn_norm.weight", w.norm(e))
        _ffn(w, p, shape, add)


def _gemma3(writer: Any, w: _Weights, shape: ModelShape, add: Callable[[str, np.ndarray], None]) -> None:
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
        writer.add_sliding_window_pattern(shape.swa_pattern)
    e = shape.n_embd
    add("output_norm.weight", w.norm(e))
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", w.norm(e))
        _attention(w, p, shape, add)
        add(p + "attn_q_norm.weight", w.norm(shape.head_dim))
        add(p + "attn_k_norm.weight", w.norm(shape.head_dim))
        add(p + "post_attention_norm.weight", w.norm(e))
        add(p + "ffn_norm.weight", w.norm(e))
        _ffn(w, p, shape, add)
        add(p + "post_ffw_norm.weight", w.norm(e))


def _lfm2(writer: Any, w: _Weights, shape: ModelShape, add: Callable[[str, np.ndarray], None]) -> None:
    if shape.n_head * shape.head_dim != shape.n_embd:
        raise ValueError("lfm2 needs n_head * head_dim == n_embd (attn_output is n_embd x n_embd)")
    # A layer without KV heads is a short convolution (llama_model_lfm2: is_recr = n_head_kv == 0).
    writer.add_head_count_kv([shape.n_head_kv if il in shape.attn_layers else 0 for il in range(shape.n_layer)])
    writer.add_shortconv_l_cache(shape.conv_kernel)
    e = shape.n_embd
    add("token_embd_norm.weight", w.norm(e))  # LFM2's output norm (llama.cpp keeps the converter's name)
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", w.norm(e))
        if il in shape.attn_layers:
            add(p + "attn_q_norm.weight", w.norm(shape.head_dim))
            add(p + "attn_k_norm.weight", w.norm(shape.head_dim))
            _attention(w, p, shape, add)
        else:
            add(p + "shortconv.conv.weight", w.small(e, shape.conv_kernel))
            add(p + "shortconv.in_proj.weight", w.matrix(3 * e, e))
            add(p + "shortconv.out_proj.weight", w.matrix(e, e))
        add(p + "ffn_norm.weight", w.norm(e))
        _ffn(w, p, shape, add)


def _mamba2(writer: Any, w: _Weights, shape: ModelShape, add: Callable[[str, np.ndarray], None]) -> None:
    e, d_inner, d_state, n_head = shape.n_embd, 2 * shape.n_embd, shape.ssm_state, shape.n_head
    if d_inner % n_head:
        raise ValueError(f"mamba2 needs n_head to divide d_inner {d_inner}")
    conv_dim = d_inner + 2 * d_state  # one group: x, B, C go through the convolution
    writer.add_ssm_conv_kernel(shape.conv_kernel)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(n_head)
    writer.add_ssm_group_count(1)
    add("output_norm.weight", w.norm(e))
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", w.norm(e))
        add(p + "ssm_in.weight", w.matrix(d_inner + conv_dim + n_head, e))  # z, xBC, dt
        add(p + "ssm_conv1d.weight", w.small(conv_dim, shape.conv_kernel))
        add(p + "ssm_conv1d.bias", w.small(conv_dim))
        add(p + "ssm_dt.bias", w.small(n_head))
        add(p + "ssm_a", -np.exp(w.small(n_head, 1)))  # A = -exp(A_log) < 0: a decaying state
        add(p + "ssm_d", w.norm(n_head).reshape(n_head, 1))
        add(p + "ssm_norm.weight", w.norm(d_inner).reshape(1, d_inner))
        add(p + "ssm_out.weight", w.matrix(e, d_inner))


_LAYERS = {"llama": _llama, "gemma3": _gemma3, "lfm2": _lfm2, "mamba2": _mamba2}


def write_random_model(
    path: str | Path, tokenizer_from: str | Path, shape: ModelShape = ModelShape(), *, arch: str = "llama",
    seed: int = 0, name: str = "kvtier-random", edit_tokenizer: TokenizerEdit | None = None,
) -> Path:
    """Write a random-weight GGUF of architecture ``arch`` (one of ``ARCHS``) to ``path``.

    Args:
        path: output file.
        tokenizer_from: a GGUF whose ``tokenizer.*`` metadata is copied (vocabulary size follows it).
        shape: the model's hyperparameters.
        arch: ``general.architecture``.
        seed: weights seed; the same seed, shape and arch give a byte-identical file.
        name: ``general.name``.
        edit_tokenizer: ``(key, value) -> value`` applied to each copied ``tokenizer.*`` value
            (strings as bytes): a vocabulary that tokenizes some text differently.

    Returns:
        ``path``.
    """
    import gguf

    if arch not in _LAYERS:
        raise ValueError(f"arch {arch!r} is not one of {ARCHS}")
    shape.check()
    path = Path(path)
    w = _Weights(seed)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name(name)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    if arch != "mamba2":  # attention hyperparameters (lfm2 sets its per-layer KV head counts itself)
        writer.add_feed_forward_length(shape.n_ff)
        writer.add_head_count(shape.n_head)
        if arch != "lfm2":
            writer.add_head_count_kv(shape.n_head_kv)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = _copy_tokenizer(writer, gguf.GGUFReader(str(tokenizer_from)), edit_tokenizer)
    writer.add_vocab_size(n_vocab)
    writer.add_tensor("token_embd.weight", w.matrix(n_vocab, shape.n_embd))
    # No output.weight: every architecture here ties the output to token_embd when it is absent.
    _LAYERS[arch](writer, w, shape, writer.add_tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_random_llama(
    path: str | Path, tokenizer_from: str | Path, shape: ModelShape = ModelShape(), *, seed: int = 0,
    name: str = "kvtier-random", edit_tokenizer: TokenizerEdit | None = None,
) -> Path:
    """``write_random_model`` for the llama architecture (one dense KV cache)."""
    return write_random_model(path, tokenizer_from, shape, arch="llama", seed=seed, name=name,
                              edit_tokenizer=edit_tokenizer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.ggufgen", description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--like", required=True, help="GGUF to copy the tokenizer from")
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    for f in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "sliding_window"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(ModelShape(), f))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    shape = ModelShape(a.n_layer, a.n_embd, a.n_head, a.n_head_kv, a.head_dim, a.n_ff, sliding_window=a.sliding_window)
    print(write_random_model(a.out, a.like, shape, arch=a.arch, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
