"""The Gemma 3 serving parts on made-up data (no weights needed): the tokenizer's rules, the
GGUF unpacked into the cache and read back, sampling keys, batch invariance of the forward."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fm_serve.gemma.config import GemmaConfig
from fm_serve.gemma.model import GemmaModel
from fm_serve.gemma.params import Blocks, GemmaParams
from fm_serve.gemma.tokenizer import Tokenizer, TokenizerTables
from fm_serve.sampling import sample

BYTES = [f"<0x{b:02X}>" for b in range(256)]
NORMAL, CONTROL, USER, BYTE = 1, 3, 4, 6


def _tokenizer(pieces: list[tuple[str, int]]) -> Tokenizer:
    """Specials at 0-3, the byte pieces, then `pieces` in rank order."""
    head = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", CONTROL)]
    rows = head + [(b, BYTE) for b in BYTES] + pieces
    tables = TokenizerTables(
        tokens=[p for p, _ in rows],
        types=[t for _, t in rows],
        bos_id=2,
        eos_id=1,
        unk_id=3,
        pad_id=0,
        add_bos=True,
    )
    return Tokenizer(tables)


def test_tokenizer_merges_by_vocabulary_rank_then_longer_left_part() -> None:
    """Pins merges ranked by score or by position in the text instead of by the merged
    piece's rank: 'bc' (rank before 'ab') is merged first although 'ab' comes first."""
    tok = _tokenizer([("a", NORMAL), ("b", NORMAL), ("c", NORMAL), ("bc", NORMAL), ("ab", NORMAL)])
    assert [tok.pieces[i] for i in tok.encode("abc", add_bos=False)] == ["a", "bc"]
    tok = _tokenizer(
        [(c, NORMAL) for c in "abcd"] + [("ab", NORMAL), ("cd", NORMAL), ("abcd", NORMAL)]
    )
    assert [tok.pieces[i] for i in tok.encode("abcd")] == ["<bos>", "abcd"]


def test_tokenizer_byte_fallback_added_tokens_and_spaces() -> None:
    """Pins byte fallback for characters outside the vocabulary, added tokens cut out
    leftmost-longest, spaces as U+2581 and runs of real spaces respelled."""
    pieces = [("a", NORMAL), ("\u2581", NORMAL), ("\u2581a", NORMAL), ("  ", USER)]
    pieces += [("\n", USER), ("\n\n", USER), ("<turn>", CONTROL), ("<tu", CONTROL)]
    tok = _tokenizer(pieces)
    ids = tok.encode("a a\n\n\n<turn>é", add_bos=False)
    names = [tok.pieces[i] for i in ids]
    assert names == ["a", "\u2581a", "\n\n", "\n", "<turn>", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "a a\n\n\n<turn>é"
    assert tok.decode(ids, skip_special=True) == "a a\n\n\né"
    assert tok.pieces[tok.ids["\u2581\u2581"]] == "\u2581\u2581"  # "  " respelled
    broken = [tok.ids["<0xC3>"], tok.ids["a"]]
    assert tok.decode(broken) == "\ufffda"  # a byte run that is not UTF-8: one U+FFFD per byte


def _tiny_config() -> GemmaConfig:
    return GemmaConfig(
        vocab=300, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
        sliding_window=4, global_every=3,
    )  # fmt: skip


def _random_params(cfg: GemmaConfig, seed: int = 0) -> GemmaParams:
    rng = np.random.default_rng(seed)
    d, hd, L = cfg.d_model, cfg.head_dim, cfg.n_layers

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 2 else 1)).astype(
            np.float32
        )

    def norm(*shape: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    blocks = Blocks(
        attn_norm=norm(L, d),
        wq=w(L, d, cfg.n_heads * hd),
        wk=w(L, d, hd),
        wv=w(L, d, hd),
        q_norm=norm(L, hd),
        k_norm=norm(L, hd),
        wo=w(L, cfg.n_heads * hd, d),
        post_attn_norm=norm(L, d),
        ffn_norm=norm(L, d),
        w_gate=w(L, d, cfg.d_ff),
        w_up=w(L, d, cfg.d_ff),
        w_down=w(L, cfg.d_ff, d),
        post_ffn_norm=norm(L, d),
    )
    return GemmaParams(w(cfg.vocab, d) * 0.1, blocks, norm(d))


def _write_gguf(path: Path, cfg: GemmaConfig, p: GemmaParams, tables: TokenizerTables) -> None:
    gguf = pytest.importorskip("gguf", reason="writing a GGUF needs gguf (the [model] extra)")
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in [
        ("embedding_length", cfg.d_model),
        ("block_count", cfg.n_layers),
        ("feed_forward_length", cfg.d_ff),
        ("attention.head_count", cfg.n_heads),
        ("attention.head_count_kv", cfg.n_kv_heads),
        ("attention.key_length", cfg.head_dim),
        ("attention.value_length", cfg.head_dim),
        ("attention.sliding_window", cfg.sliding_window),
    ]:
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.rope.freq_base", cfg.rope_global_base)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", cfg.norm_eps)
    w.add_tokenizer_model("llama")
    w.add_token_list(tables.tokens)
    w.add_token_types(tables.types)
    w.add_bos_token_id(tables.bos_id)
    w.add_eos_token_id(tables.eos_id)
    w.add_unk_token_id(tables.unk_id)
    w.add_pad_token_id(tables.pad_id)
    w.add_add_bos_token(tables.add_bos)
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", gguf.quants.quantize(p.embed, q8), raw_dtype=q8)
    w.add_tensor("output_norm.weight", p.final_norm)
    from fm_serve.gemma.params import GGUF_BLOCK_NAMES, MATRICES

    for field, name in GGUF_BLOCK_NAMES.items():
        for i, arr in enumerate(getattr(p.blocks, field)):
            w.add_tensor(
                f"blk.{i}.{name}.weight", np.ascontiguousarray(arr.T if field in MATRICES else arr)
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_is_unpacked_once_and_read_back_from_the_cache(tmp_path: Path) -> None:
    """Pins an unpack that transposes, drops or reorders a tensor, a config read wrongly from
    the metadata, or a second start that unpacks again instead of reading the cache."""
    from fm_serve.gemma.load import load_model

    cfg = _tiny_config()
    tables = _tokenizer([("a", NORMAL)]).tables
    cfg = cfg._replace(vocab=len(tables.tokens))
    p = _random_params(cfg)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, cfg, p, tables)
    first = load_model(gguf=path, cache_root=tmp_path / "cache")
    second = load_model(gguf=path, cache_root=tmp_path / "cache")
    assert first.unpacked and not second.unpacked
    # what the GGUF leaves out is Gemma 3's: every sixth layer global, scale head_dim ** -0.5
    fixed = {"global_every": 6, "query_scale": cfg.head_dim**-0.5}
    assert second.model.cfg == cfg._replace(norm_eps=float(np.float32(cfg.norm_eps)), **fixed)
    assert second.tokenizer.tables == tables
    for got, want in zip(
        jax.tree.leaves(second.params.blocks), jax.tree.leaves(p.blocks), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_allclose(np.asarray(second.params.embed), p.embed, atol=2e-3)  # Q8_0


def test_a_row_s_logits_do_not_depend_on_its_batch() -> None:
    """Pins a forward whose rows round differently with the batch's size or their place in
    it: the synchronous and overlap loops would then serve different tokens."""
    cfg = _tiny_config()
    m = GemmaModel(cfg, max_seq_len=16, row_tile=4)
    params = jax.tree.map(jnp.asarray, _random_params(cfg))
    fwd = jax.jit(m.forward)
    ids = np.array([5, 9, 11, 3], np.int32)
    alone = fwd(
        params,
        m.init_cache(4),
        ids,
        np.full(4, 2, np.int32),
        np.arange(4, dtype=np.int32),
        np.array([3, 0, 0, 0], np.int32),
    )
    # the same sequence at the end of a batch of 8 tokens, another sequence first
    ids8 = np.concatenate([np.array([7, 8, 2, 1], np.int32), ids])
    slots8 = np.array([1, 1, 1, 1, 2, 2, 2, 2], np.int32)
    pos8 = np.array([0, 1, 2, 3, 0, 1, 2, 3], np.int32)
    both = fwd(
        params, m.init_cache(4), ids8, slots8, pos8, np.array([3, 7, 0, 0, 0, 0, 0, 0], np.int32)
    )
    np.testing.assert_array_equal(np.asarray(alone[0])[0], np.asarray(both[0])[1])


def test_sampling_keys_are_the_request_s_seed_and_position() -> None:
    """Pins a draw keyed by the row (a batch's order) rather than by (seed, position), a
    temperature-0 row that is not the argmax, or a seed the draw ignores."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 1000)), jnp.float32)
    temp = jnp.array([0.0, 1.0, 1.0, 1.0], jnp.float32)
    seeds = jnp.array([3, 3, 4, 3], jnp.int32)
    pos = jnp.array([5, 5, 5, 6], jnp.int32)
    got = np.asarray(sample(logits, temp, seeds, pos))
    assert got[0] == int(jnp.argmax(logits[0]))
    swapped = np.asarray(sample(logits[::-1], temp[::-1], seeds[::-1], pos[::-1]))[::-1]
    np.testing.assert_array_equal(got, swapped)
    flat = jnp.zeros((3, 1000), jnp.float32)  # every token equally likely: draws show keys
    draws = np.asarray(sample(flat, jnp.ones(3), jnp.array([3, 4, 3]), jnp.array([5, 5, 6])))
    assert len(set(draws.tolist())) == 3
