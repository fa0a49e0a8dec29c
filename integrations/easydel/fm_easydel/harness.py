"""A tiny eSurge for tests and figures: a random 2-layer Llama (hidden 64, vocab 64) and a
WordLevel tokenizer trained here, saved to a directory (eSurge's tokenizer and detokenizer
worker processes load it by path). `Run` builds one engine, serves prompts, and reaps the
worker processes it started."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._compat import import_easydel

WORDS = [f"w{i}" for i in range(58)]
SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "[STOP]", "[SEP]"]
VOCAB = 64


def save_tokenizer(directory: str | Path) -> Path:
    """Train a WordLevel tokenizer on a generated corpus, wrap it, save it to `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=1)
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tokenizer vocab is {tok.get_vocab_size()}, expected {VOCAB}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
    )
    path = Path(directory)
    fast.save_pretrained(path)
    return path


def tiny_llama(seed: int = 0) -> Any:
    """A random Llama: 2 layers, hidden 64, vocab 64, float32."""
    ed = import_easydel()
    import jax.numpy as jnp
    from flax import nnx

    cfg = ed.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    return ed.LlamaForCausalLM(
        config=cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(seed)
    )


def limit_kv_budget(nbytes: int) -> None:
    """eSurge sizes its KV page pool from device memory stats; the CPU has none, so it takes
    4 GiB, and a step then touches the whole pool. Cap the budget every cache reads."""
    import importlib

    for name in (
        "easydel.caching.ragged_page.cache",
        "easydel.caching.unified_attention.cache",
    ):
        mod = importlib.import_module(name)
        mod.per_device_hbm_budget_bytes = lambda util=0.9, mode="free", safety_margin=0: nbytes


def _children() -> set[int]:
    """Pids of this process's live children (from /proc)."""
    me = os.getpid()
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(entry))
    return out


@dataclass
class EngineSpec:
    """One eSurge configuration: what both the shipped loop and fm_jax's run on."""

    tokenizer_dir: str
    max_model_len: int = 128
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 16  # small: long prompts are prefilled in chunks
    page_size: int = 8
    kv_budget_bytes: int = 1 << 20
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def engine(
    spec: EngineSpec, *, relay: bool, model: Any = None, copy_inputs: bool = True
) -> Iterator[Any]:
    """An initiated eSurge: as shipped (`relay=False`: the synchronous loop) or on fm_jax's
    relay with the reordered loop. Terminated on exit, and every worker process it started
    (tokenizer, detokenizer) reaped: stopped politely, then killed after 5 s."""
    ed = import_easydel()
    import jax.numpy as jnp

    limit_kv_budget(spec.kv_budget_bytes)
    before = _children()
    kwargs: dict[str, Any] = dict(
        model=model if model is not None else tiny_llama(),
        tokenizer=spec.tokenizer_dir,
        dtype=jnp.float32,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        page_size=spec.page_size,
        min_input_pad=spec.max_num_seqs,
        enable_prefix_caching=False,
        silent_mode=True,
        overlap_execution=relay,
        async_scheduling=True,
    )
    kwargs.update(spec.extra)
    started: set[int] = set()
    eng = None
    try:
        if relay:
            from .engine import build

            eng = build(**kwargs)
        else:
            from .patches import install

            install()
            eng = ed.eSurge(**kwargs)
            # eSurge as shipped, with one change: numpy inputs copied at device_put (see
            # patches.py). Without it the shipped engine's penalized outputs varied from run
            # to run here; the likely cause is the same race: `_update_placeholder` bumps, in
            # place and right after dispatch, the sequence lengths the sampler's
            # penalty-count rebuild was handed.
            eng.runner._fm_copy_inputs = copy_inputs
        started = _children() - before
        eng.initiate()  # already running: eSurge starts its loop in its constructor
        yield eng
    finally:
        if eng is not None:
            with contextlib.suppress(Exception):
                eng.terminate()
            with contextlib.suppress(Exception):
                eng._worker_manager.shutdown()
        reap(started | (_children() - before))


def reap(pids: set[int], grace: float = 5.0) -> list[int]:
    """SIGTERM the given child pids still alive, SIGKILL what is left after `grace` seconds,
    and wait for each; returns the pids that had to be killed."""
    live = pids & _children()
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        for pid in list(live):
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    continue
            live.discard(pid)
        time.sleep(0.05)
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return sorted(live)


def prompt(words: list[int]) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in words)
