"""Gemma 3 270M ready to serve: weights on the device, tokenizer, timings of the load.

`load_model` reads the real weights (the `[model]` extra: gguf and the weights package);
`random_model` builds the same architecture with random weights and no tokenizer, for
throughput on a machine without them (neither imports gguf).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fm_serve.gemma import files, unpack
from fm_serve.gemma.config import GemmaConfig
from fm_serve.gemma.model import GemmaModel
from fm_serve.gemma.params import Blocks, GemmaParams
from fm_serve.gemma.tokenizer import Tokenizer

END_OF_TURN = "<end_of_turn>"


@dataclass(frozen=True)
class Loaded:
    """A loaded model and how its load went.

    Attributes:
      model: the model as the serving loop runs it (config, cache length, row tile, stops).
      params: the weights, on the default device.
      tokenizer: the GGUF's tokenizer; None for random weights (prompts are token ids).
      unpacked: this load dequantized the GGUF into the cache (a first start).
      load_s: wall time of the load (unpacking included when `unpacked`).
      source: the directory the weights were read from; None for random weights.
    """

    model: GemmaModel
    params: GemmaParams
    tokenizer: Tokenizer | None
    unpacked: bool
    load_s: float
    source: Path | None


def load_model(
    *,
    gguf: Path | None = None,
    cache_root: Path | None = None,
    max_seq_len: int = 512,
    row_tile: int = 8,
) -> Loaded:
    """Load Gemma 3 from the cache, unpacking the GGUF into it first if it is not there.

    Args:
      gguf: a Gemma 3 GGUF file; default: the weights package's (the `[model]` extra).
      cache_root: the cache directory (default `files.cache_root()`).
      max_seq_len: KV cache positions per request slot.
      row_tile: rows per matmul tile (every bucket of the engine must be a multiple).

    Raises:
      files.ModelFilesMissing: no `gguf` given and the weights package is not installed.
    """
    t0 = time.perf_counter()
    root = cache_root or files.cache_root()
    if gguf is None:
        out = files.unpacked_dir(files.packaged_sha256(), root)
        source = None
    else:
        out = files.unpacked_dir(files.file_sha256(gguf), root)
        source = gguf
    unpacked = not unpack.is_unpacked(out)
    if unpacked:
        unpack.unpack_gguf(source or files.packaged_gguf(root), out)
    cfg, host_params, tables = unpack.read_unpacked(out)
    params = jax.tree.map(jnp.asarray, host_params)
    tokenizer = Tokenizer(tables)
    stops = [tables.eos_id]
    if END_OF_TURN in tokenizer.ids:
        stops.append(tokenizer.ids[END_OF_TURN])
    model = GemmaModel(cfg, max_seq_len=max_seq_len, row_tile=row_tile, stop_ids=tuple(stops))
    jax.block_until_ready(params)
    return Loaded(model, params, tokenizer, unpacked, time.perf_counter() - t0, out)


DTYPES = ("float32", "bfloat16")


def with_dtype(loaded: Loaded, dtype: str) -> Loaded:
    """`loaded` computing in `dtype` (its weights cast, its KV cache in `dtype`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype == loaded.model.dtype:
        return loaded
    params = jax.tree.map(lambda a: a.astype(jnp.dtype(dtype)), loaded.params)
    return replace(loaded, model=loaded.model._replace(dtype=dtype), params=params)


def random_params(cfg: GemmaConfig, seed: int = 0) -> GemmaParams:
    """Random float32 host weights of `cfg`'s shapes (numpy, seeded).

    Matrices ~ N(0, 1 / fan_in), so each block's matmuls keep unit-scale activations; the
    embedding ~ N(0, 1 / d_model), so the embedded tokens (scaled by sqrt(d_model)) are
    ~ N(0, 1) and the tied head's logits ~ N(0, 1) (far from ties, far from one-hot); norm
    scales are ones (the multiplier itself, as the GGUF stores it).
    """
    rng = np.random.default_rng(seed)
    n, d, hd = cfg.n_layers, cfg.d_model, cfg.head_dim

    def matrix(fan_in: int, fan_out: int, layers: int = n) -> np.ndarray:
        w = rng.standard_normal((layers, fan_in, fan_out), dtype=np.float32)
        w *= np.float32(1.0 / np.sqrt(fan_in))
        return w

    def ones(width: int) -> np.ndarray:
        return np.ones((n, width), np.float32)

    blocks = Blocks(
        attn_norm=ones(d),
        wq=matrix(d, cfg.n_heads * hd),
        wk=matrix(d, cfg.n_kv_heads * hd),
        wv=matrix(d, cfg.n_kv_heads * hd),
        q_norm=ones(hd),
        k_norm=ones(hd),
        wo=matrix(cfg.n_heads * hd, d),
        post_attn_norm=ones(d),
        ffn_norm=ones(d),
        w_gate=matrix(d, cfg.d_ff),
        w_up=matrix(d, cfg.d_ff),
        w_down=matrix(cfg.d_ff, d),
        post_ffn_norm=ones(d),
    )
    embed = rng.standard_normal((cfg.vocab, d), dtype=np.float32)
    embed *= np.float32(1.0 / np.sqrt(d))
    return GemmaParams(embed, blocks, np.ones(d, np.float32))


def random_model(
    *,
    max_seq_len: int,
    row_tile: int,
    dtype: str = "float32",
    seed: int = 0,
    config: GemmaConfig | None = None,
) -> Loaded:
    """Gemma 3 with random weights (`random_params`) on the default device, no tokenizer.

    Needs neither the weights package nor gguf. There is no stop token (`stop_ids` is
    empty): every request runs to its `max_new_tokens`, as a throughput benchmark wants
    (random weights would emit end of sequence rarely, and at random).

    Args:
      max_seq_len: KV cache positions per request slot.
      row_tile: rows per matmul tile (every bucket of the engine must be a multiple).
      dtype: "float32" or "bfloat16": the weights', activations' and KV cache's dtype.
      seed: the weights' numpy seed.
      config: the architecture; default `GemmaConfig()`, Gemma 3 270M.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    t0 = time.perf_counter()
    cfg = config or GemmaConfig()
    host = random_params(cfg, seed)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.dtype(dtype)), host)
    del host
    model = GemmaModel(cfg, max_seq_len=max_seq_len, row_tile=row_tile, stop_ids=(), dtype=dtype)
    jax.block_until_ready(params)
    return Loaded(model, params, None, False, time.perf_counter() - t0, None)
