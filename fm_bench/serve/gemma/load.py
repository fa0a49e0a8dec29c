"""Gemma 3 270M ready to serve: weights on the device, tokenizer, timings of the load."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from fm_bench.serve.gemma import files, unpack
from fm_bench.serve.gemma.model import GemmaModel
from fm_bench.serve.gemma.params import GemmaParams
from fm_bench.serve.gemma.tokenizer import Tokenizer

END_OF_TURN = "<end_of_turn>"


@dataclass(frozen=True)
class Loaded:
    """A loaded model and how its load went.

    Attributes:
      model: the model as the serving loop runs it (config, cache length, row tile, stops).
      params: the weights, on the default device.
      tokenizer: the GGUF's tokenizer.
      unpacked: this load dequantized the GGUF into the cache (a first start).
      load_s: wall time of the load (unpacking included when `unpacked`).
      source: the directory the weights were read from.
    """

    model: GemmaModel
    params: GemmaParams
    tokenizer: Tokenizer
    unpacked: bool
    load_s: float
    source: Path


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
