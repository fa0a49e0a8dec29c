"""Gemma 3 with random weights: `fm-serve-bench --random-weights` without the weights package.

The benchmark's random path needs neither gguf, the weights package nor a tokenizer (a GPU
machine may have none of them). The full 270M architecture takes minutes to build and
compile on a small CPU, so these tests serve a reduced `GemmaConfig` through the same code
(`load.random_model`'s `config`), the command line included.
"""

from __future__ import annotations

import functools
import json
import sys
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fm_serve.gemma import bench, load
from fm_serve.gemma.config import GemmaConfig
from fm_serve.gemma.serve import make_requests, random_requests

TINY = GemmaConfig(
    vocab=512, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_model_has_the_config_s_shapes_in_its_dtype(dtype: str) -> None:
    """Pins weights of the wrong shape or dtype, a KV cache not in the weights' dtype, or a
    model that stops requests early (random weights: every request runs to its limit)."""
    got = load.random_model(max_seq_len=16, row_tile=4, dtype=dtype, seed=3, config=TINY)
    assert got.tokenizer is None and got.source is None and got.model.stop_ids == ()
    assert got.model.cfg == TINY and got.model.dtype == dtype
    p = got.params
    assert p.embed.shape == (TINY.vocab, TINY.d_model)
    assert p.blocks.wq.shape == (TINY.n_layers, TINY.d_model, TINY.n_heads * TINY.head_dim)
    assert p.blocks.w_down.shape == (TINY.n_layers, TINY.d_ff, TINY.d_model)
    assert {a.dtype for a in jax.tree.leaves(p)} == {jnp.dtype(dtype)}
    np.testing.assert_array_equal(np.asarray(p.final_norm, np.float32), 1.0)
    assert got.model.init_cache(3).k.dtype == jnp.dtype(dtype)
    again = load.random_model(max_seq_len=16, row_tile=4, dtype=dtype, seed=3, config=TINY)
    np.testing.assert_array_equal(np.asarray(again.params.embed), np.asarray(p.embed))


def test_random_logits_are_float32_and_spread() -> None:
    """Pins degenerate random weights (logits all equal, or one token far ahead of the rest)
    and bfloat16 logits handed to sampling; bfloat16 stays close to float32."""
    fp = load.random_model(max_seq_len=16, row_tile=4, config=TINY)
    bf = load.with_dtype(fp, "bfloat16")
    ids = np.array([5, 9, 11, 3], np.int32)
    args = (ids, np.full(4, 1, np.int32), np.arange(4, dtype=np.int32), np.array([3, 0, 0, 0]))
    got = {}
    for name, m in (("f32", fp), ("bf16", bf)):
        logits, cache = jax.jit(m.model.forward)(m.params, m.model.init_cache(2), *args)
        assert logits.dtype == jnp.float32 and cache.k.dtype == m.params.embed.dtype
        got[name] = np.asarray(logits)[0]
    assert 0.3 < got["f32"].std() < 3.0
    assert np.abs(got["bf16"] - got["f32"]).max() < 0.25


def test_random_requests_are_seeded_token_ids_within_the_vocabulary() -> None:
    """Pins prompts outside [3, vocab) or the 8..32 lengths, unseeded prompts, or text
    prompts tokenized with no tokenizer."""
    m = load.random_model(max_seq_len=64, row_tile=4, config=TINY)
    reqs = random_requests(m, 20, 5, seed=1)
    assert [r.rid for r in reqs] == list(range(20))
    assert all(8 <= len(r.prompt) <= 32 and r.max_new_tokens == 5 for r in reqs)
    assert all(3 <= t < TINY.vocab for r in reqs for t in r.prompt)
    assert random_requests(m, 20, 5, seed=1) == reqs != random_requests(m, 20, 5, seed=2)
    with pytest.raises(ValueError, match="no tokenizer"):
        make_requests(m, ["text"], 4)


@pytest.mark.slow  # the overlap steps' warm-up: a minute or two on a 2-core CPU
def test_bench_serves_random_weights_without_gguf_or_matplotlib(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Pins the random-weights command line: no weights package, gguf or matplotlib needed,
    every request runs to --max-tokens, sync and overlap agree, results named by dtype."""
    monkeypatch.setattr(load, "random_model", functools.partial(load.random_model, config=TINY))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    version = metadata.version

    def no_gguf(name: str) -> str:
        if name == "gguf":
            raise metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(metadata, "version", no_gguf)
    dtype = "bfloat16"  # the GPU run's; float32 differs in the weights' cast only
    args = ["--random-weights", "--dtype", dtype, "--batch-sizes", "2", "--max-tokens", "3"]
    args += ["--repeats", "1", "--max-seq-len", "64", "--prefill-budget", "16"]
    assert bench.main([*args, "--out", str(tmp_path), "--tag", "test"]) == 0
    assert "random weights" in capsys.readouterr().out
    stem = tmp_path / f"gemma_random_{dtype}_test"
    doc = json.loads(stem.with_suffix(".json").read_text())
    assert doc["weights"] == "random" and doc["dtype"] == dtype
    assert doc["environment"]["gguf"] == "not installed"
    (b,) = doc["batches"]
    assert b["requests"] == 4 and b["output_tokens"] == 4 * 3 and b["stopped_early"] == 0
    assert b["tokens_equal"] and b["runs"][0]["sync_tok_s"] > 0
    md = stem.with_suffix(".md").read_text()
    assert f"random weights, {dtype}" in md and "gguf not installed" in md and "![" not in md
    assert not stem.with_suffix(".png").exists()
    assert not (tmp_path / "gemma_serve_test.json").exists()


def test_bench_refuses_startup_with_random_weights() -> None:
    """Pins `--startup` (fm-serve on the real weights) silently mixed into a random run."""
    with pytest.raises(SystemExit):
        bench.main(["--random-weights", "--startup"])


def test_bound_counts_the_model_s_weights_and_sets_tok_s_beside_it() -> None:
    """The bound: the matmul weights are the blocks' projections and the tied output layer
    (no norm); a decode step is memory-bound at one row and compute-bound once its FLOPs
    outlast the weight read; the table sets each B's tokens/s against B / bound step."""
    from fm_serve.gemma import bound

    got = load.random_model(max_seq_len=16, row_tile=4, dtype="float32", config=TINY)
    c = TINY
    per_layer = c.d_model * (2 * c.n_heads * c.head_dim + 2 * c.n_kv_heads * c.head_dim)
    per_layer += 3 * c.d_model * c.d_ff
    assert bound.matmul_weights(got.params) == c.n_layers * per_layer + c.vocab * c.d_model
    rates = bound.machine_rates(got.params)
    assert rates["weight_bytes"] == sum(x.nbytes for x in jax.tree_util.tree_leaves(got.params))
    assert rates["weight_read_ms"] > 0 and rates["matmul_gflop_s"] > 0
    fake = {"weight_read_ms": 10.0, "matmul_gflop_s": 100.0, "matmul_weights": 1e8}
    one, many = bound.decode_bound(fake, 1), bound.decode_bound(fake, 64)
    assert one == {"step_ms": 10.0, "tok_s": 100.0, "compute_ms": 2.0, "roof": "memory"}
    assert many["roof"] == "compute" and many["step_ms"] == pytest.approx(128.0)
    run = {"host_cost_ratio": 0, "t_step_ms": 20.0, "sync_tok_s": 50.0, "overlap_tok_s": 80.0}
    doc = {"bound": {**fake, "weight_bytes": 4e8, "bandwidth_gb_s": 40.0}, "row_tile": 4}
    doc["prefill_budget"] = 32
    doc["batches"] = [{"batch": 1, "runs": [run]}]
    row = bench.bound_lines(doc)[-1]
    assert row == "| 1 | 20.0 | 10.0 | memory | 1 | 50.0 | 80.0 | 100.0 | 0.50 | 0.80 |"
