"""The JAX Gemma 3 against transformers' Gemma 3 on the same GGUF: logits, greedy tokens and
the tokenizer.

transformers (the test extra) is a reference nobody here wrote: it reads the GGUF's
architecture, dequantizes its tensors and builds its tokenizer itself. On every prompt the
served greedy tokens (the engine's synchronous loop, all prompts in one batch, the longest
prefilled in chunks) equal transformers' greedy tokens for GREEDY_STEPS steps, and the
logits of every position of prompt + continuation agree within LOGIT_ATOL.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.gemma_weights import require_weights

require_weights()
pytestmark = pytest.mark.slow  # transformers reads the GGUF: minutes on 2 cores
torch = pytest.importorskip("torch", reason="the reference needs torch (the torch extra)")
transformers = pytest.importorskip(
    "transformers", reason="the reference needs transformers (the test extra)"
)

import jax  # noqa: E402

from fm_serve.config import engine_for  # noqa: E402
from fm_serve.engine import Engine  # noqa: E402
from fm_serve.gemma import files  # noqa: E402
from fm_serve.gemma.load import Loaded, load_model  # noqa: E402
from fm_serve.requests import Request  # noqa: E402

GREEDY_STEPS = 24
LOGIT_ATOL = 2e-3  # logits span about +-30; float32 on both sides, summed in other orders
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n",
    "Gemma is a family of lightweight, state-of-the-art open models built from the same "
    "research and technology used to create the Gemini models. They are text-to-text, "
    "decoder-only large language models, available in English, with open weights. The "
    "smallest of them",
]
TOKENIZER_TEXTS = PROMPTS + [
    "",
    "  two  spaces\n\n\nand\ttabs\t\t<b>bold</b> <unused7>",
    "naïve café 日本語 🤖 𝔹 \u200b\x7f",
    "<bos><eos>[multimodal]<start_of_image>x",
    "   leading and trailing   ",
]


@pytest.fixture(scope="module")
def loaded() -> Loaded:
    return load_model(max_seq_len=128)


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """transformers' tokenizer and float32 model, both read from the packaged GGUF."""
    gguf = files.packaged_gguf()
    where = {"gguf_file": gguf.name}
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, **where)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, **where
    )
    return tok, model.eval()


def _reference_greedy(model: Any, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation (argmax of each step's logits, its own KV cache)
    and its logits at every position of the prompt and the continuation but the last."""
    out: list[int] = []
    logits = []
    with torch.no_grad():
        step = model(torch.tensor([ids]), use_cache=True)
        for i in range(steps):
            logits.append(step.logits[0].numpy())
            out.append(int(torch.argmax(step.logits[0, -1])))
            if i + 1 < steps:
                step = model(torch.tensor([[out[-1]]]), cache=step.cache, use_cache=True)
    return out, np.concatenate(logits)


def _jax_logits(loaded: Loaded, seqs: list[list[int]], window: int | None = None) -> list[Any]:
    """The JAX model's logits [len(seq), V] at every position of each sequence, all in one
    forward (sequence i in slot i + 1), as one row tile (these are not served batches)."""
    n = sum(len(s) for s in seqs)
    t = n + (-n % 8)
    cfg = loaded.model.cfg if window is None else loaded.model.cfg._replace(sliding_window=window)
    m = loaded.model._replace(cfg=cfg, row_tile=t)
    ids, slots, pos = (np.zeros(t, np.int32) for _ in range(3))
    at = 0
    for i, seq in enumerate(seqs):
        ids[at : at + len(seq)] = seq
        slots[at : at + len(seq)] = i + 1
        pos[at : at + len(seq)] = np.arange(len(seq))
        at += len(seq)
    every = np.arange(t, dtype=np.int32)
    logits, _ = jax.jit(m.forward)(
        loaded.params, m.init_cache(len(seqs) + 1), ids, slots, pos, every
    )
    logits = np.asarray(logits)
    bounds = np.cumsum([0] + [len(s) for s in seqs])
    return [logits[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def test_tokenizer_encodes_and_decodes_as_the_reference(
    loaded: Loaded, reference: tuple[Any, Any]
) -> None:
    """Pins a tokenizer that cuts text into other pieces than transformers' (merge order,
    byte fallback, whitespace runs, added tokens) or decodes ids to other text."""
    hf_tok, _ = reference
    tok = loaded.tokenizer
    for text in TOKENIZER_TEXTS:
        ids = hf_tok(text)["input_ids"]
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == hf_tok.decode(ids), text
        assert tok.decode(ids, skip_special=True) == hf_tok.decode(ids, skip_special_tokens=True)


def test_served_greedy_tokens_and_logits_match_the_reference(
    loaded: Loaded, reference: tuple[Any, Any]
) -> None:
    """Pins a model that departs from Gemma 3 as transformers runs it (a norm, RoPE base,
    attention scale, GELU form or the embedding's scale wrong), or a serving path (chunked
    prefill, the KV cache, the batch) that changes greedy tokens."""
    _, hf = reference
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    model = loaded.model._replace(stop_ids=())  # GREEDY_STEPS tokens whatever comes
    cfg = engine_for(max_running=len(prompts), prefill_budget=16, row_tile=model.row_tile)
    assert max(len(p) for p in prompts) > cfg.prefill_budget  # one prompt is chunked
    requests = [Request(i, tuple(p), GREEDY_STEPS) for i, p in enumerate(prompts)]
    served = Engine(model, loaded.params, cfg).run_sync(requests)
    seqs, refs = [], []
    for i, ids in enumerate(prompts):
        want, ref_logits = _reference_greedy(hf, ids, GREEDY_STEPS)
        assert served.outputs[i] == want, PROMPTS[i]
        seqs.append(ids + want[:-1])  # the last token's logits are nobody's input
        refs.append(ref_logits)
    for text, ref, got in zip(PROMPTS, refs, _jax_logits(loaded, seqs), strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=LOGIT_ATOL, err_msg=text)


def test_sliding_window_masks_as_the_reference(loaded: Loaded, reference: tuple[Any, Any]) -> None:
    """Pins a local layer's window off by one or applied to the global layers: with the
    window cut to 8 positions on both sides, a 40-token sequence's logits still agree (the
    model's own 512 is longer than any sequence served here)."""
    _, hf = reference
    window = 8
    ids = loaded.tokenizer.encode(PROMPTS[3])[:40]
    got, full = _jax_logits(loaded, [ids, ids], window=window)[0], _jax_logits(loaded, [ids])[0]
    saved = hf.config.sliding_window
    hf.config.sliding_window = window
    try:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
    finally:
        hf.config.sliding_window = saved
    np.testing.assert_allclose(got, ref, rtol=0, atol=LOGIT_ATOL)
    assert np.abs(got - full)[window:].max() > 100 * LOGIT_ATOL  # the window mattered
