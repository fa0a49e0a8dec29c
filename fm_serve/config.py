"""Settings of the demo model and engine: a default size and a tiny size for tests."""

from __future__ import annotations

from typing import NamedTuple


class ModelConfig(NamedTuple):
    """Shapes of the decoder-only transformer (static: every field is a trace-time constant).

    Attributes:
      vocab: vocabulary size V.
      d_model: residual width.
      n_layers: transformer blocks.
      n_heads: attention heads (d_model must divide evenly).
      d_ff: MLP hidden width.
      max_seq_len: S, KV cache positions per slot (prompt + output must fit).
      eos_id: the end-of-sequence token.
      eos_bias: added to the EOS logit so that random weights stop some requests early.
      seed: PRNG seed of the random weights.
      row_tile: rows per GEMM tile (batch invariance, see tiles.by_tiles); divides every bucket.
    """

    vocab: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    max_seq_len: int = 80
    eos_id: int = 1
    eos_bias: float = 1.5
    seed: int = 0
    row_tile: int = 8

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads


class EngineConfig(NamedTuple):
    """Static limits of the continuous-batching engine.

    Attributes:
      max_running: live requests at once; the pool has max_running + 1 slots (slot 0 pads).
      prefill_budget: prompt tokens per step across prefill rows (chunked prefill).
      batch_buckets: allowed batch sizes (rows); padding rows carry slot 0.
      token_buckets: allowed flat token counts; padding tokens carry slot 0.
      mixed: build MIXED batches (prefill chunks beside running decodes); False: a step
        with a prefill chunk runs no decode row.
      kv_budget: KV positions all running requests may hold at once (None: no limit
        beyond the slots); the newest is retracted and later resumed when it would be passed.
    """

    max_running: int = 16
    prefill_budget: int = 32
    batch_buckets: tuple[int, ...] = (16,)  # one row bucket: fewer compiles in the demo
    token_buckets: tuple[int, ...] = (16, 48)  # DECODE steps, steps with a prefill chunk
    mixed: bool = True
    kv_budget: int | None = None

    @property
    def pool_size(self) -> int:
        """R, request-pool rows: max_running live slots plus the padding slot 0."""
        return self.max_running + 1


def accelerator_model() -> ModelConfig:
    """The default on a GPU or TPU: a step whose device time is several times its dispatch.

    At the CPU default's size (d_model 256, 4 layers) an H100 step is its ~60 kernel
    launches (the step call returns only after 2.0-2.5 ms of a 2.4 ms step): the host is
    busy for the whole forward and there is nothing to overlap. Measured on an H100 (jax
    0.11.2): d_model 2048 x 8 layers, step 6.2 ms for 2.4 ms of dispatch; d_model 4096 x 8
    layers, step 15 ms for 3 ms (5x), which overlaps to 1.64x at host cost 1x the forward.
    """
    return ModelConfig(d_model=4096, n_layers=8, n_heads=32, d_ff=4 * 4096)


def tiny_model() -> ModelConfig:
    """A model small enough for unit tests (compiles and runs in seconds)."""
    return ModelConfig(
        vocab=512,
        d_model=32,
        n_layers=2,
        n_heads=2,
        d_ff=64,
        max_seq_len=64,
        row_tile=4,
        eos_bias=1.0,
    )


def tiny_engine() -> EngineConfig:
    """An engine small enough for unit tests, still exercising chunking, MIXED and slot reuse."""
    return EngineConfig(max_running=6, prefill_budget=12, batch_buckets=(4, 8), token_buckets=(24,))


class RequestShape(NamedTuple):
    """Ranges (inclusive) of prompt lengths and output caps of a request set."""

    prompt_len: tuple[int, int]
    max_new: tuple[int, int]


DEFAULT_REQUESTS = RequestShape(prompt_len=(8, 40), max_new=(4, 24))
TINY_REQUESTS = RequestShape(prompt_len=(3, 30), max_new=(1, 20))


def engine_for(
    max_running: int, prefill_budget: int, row_tile: int, kv_budget: int | None = None
) -> EngineConfig:
    """An engine with one batch bucket and two token buckets, every one a multiple of
    `row_tile`: decode steps (one token per row) and steps with a prefill chunk."""
    up = lambda n: n + (-n % row_tile)  # noqa: E731
    rows = up(max_running)
    return EngineConfig(
        max_running=max_running,
        prefill_budget=prefill_budget,
        batch_buckets=(rows,),
        token_buckets=tuple(sorted({rows, up(prefill_budget + max_running)})),
        kv_budget=kv_budget,
    )
