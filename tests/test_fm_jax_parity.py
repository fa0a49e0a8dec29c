"""fm_jax against fm_torch on the same op sequences: buffers and resolved outputs, raw bytes.

The jax map pads every batch to a bucket with slot-0 rows, so slot 0 (the padding row,
garbage by contract) is left out of buffer comparisons; slots 1..R-1 must match bitwise.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fm_jax as fj
import fm_torch as ft

R = 8
BATCH_BUCKETS = (2, 4, 8)
TOKEN_BUCKETS = (4, 8, 16)
K, H = 2, 3

# Float payloads whose bits must survive the relay: NaNs with payloads (quiet and
# signalling, both signs), -0.0, +-inf.
F32_SPECIAL = np.array(
    [0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 0x7F800000, 0xFF800000], np.uint32
)
F16_SPECIAL = np.array([0x7E01, 0xFE23, 0x7C01, 0x8000, 0x7C00, 0xFC00], np.uint16)
BF16_SPECIAL = np.array([0x7FC1, 0xFFA3, 0x7F81, 0x8000, 0x7F80, 0xFF80], np.uint16)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def jax_bytes(x: object) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def assert_buffers_match(fm: fj.FutureMap, tm: ft.FutureMap, step: int) -> None:
    """Every jax buffer matches its torch twin bitwise on slots 1..R-1."""
    bufs = fm.buffers()
    for name, jbuf in bufs.items():
        tbuf = getattr(tm, name)
        assert tbuf is not None, f"step {step}: torch has no {name}"
        assert np.asarray(jbuf).dtype.itemsize == tbuf.element_size(), name
        assert jax_bytes(jbuf[1:]) == tensor_bytes(tbuf[1:]), f"step {step}: {name} differs"
    if tm.hidden_states is not None:
        assert "hidden_states" in bufs


def special_floats(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random floats of `dtype` ('f32', 'f16', 'bf16') as raw bits, with NaN/-0/inf mixed in."""
    n = int(np.prod(shape))
    if dtype == "f32":
        raw = rng.standard_normal(n).astype(np.float32).view(np.uint32)
        special = F32_SPECIAL
    else:
        f = rng.standard_normal(n).astype(np.float32)
        if dtype == "f16":
            raw, special = f.astype(np.float16).view(np.uint16), F16_SPECIAL
        else:  # bf16: the top half of the f32 bits (truncation is fine for test data)
            raw, special = (f.view(np.uint32) >> 16).astype(np.uint16), BF16_SPECIAL
    mask = rng.random(n) < 0.4
    raw = raw.copy()
    raw[mask] = rng.choice(special, int(mask.sum()))
    return raw.reshape(shape)


def as_jax_floats(raw: np.ndarray, dtype: str) -> np.ndarray:
    return raw.view({"f32": np.float32, "f16": np.float16, "bf16": jnp.bfloat16}[dtype])


def as_torch_floats(raw: np.ndarray, dtype: str) -> torch.Tensor:
    signed = raw.view(np.int32 if dtype == "f32" else np.int16)
    torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    return torch.from_numpy(signed.copy()).view(torch_dtype)


def t64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.int64).copy())


class Driver:
    """Runs one overlap-loop op sequence into both maps and checks they agree."""

    def __init__(self, fm: fj.FutureMap, tm: ft.FutureMap) -> None:
        self.fm, self.tm = fm, tm

    def resolve(
        self,
        mode: fj.ForwardMode,
        idx: np.ndarray,
        ids: np.ndarray,
        lens: np.ndarray,
        draft_idx: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, tuple[bytes, ...] | None]:
        n, t = len(idx), len(ids)
        res = self.fm.resolve(fj.Batch(mode, idx, ids, lens, draft_idx))
        tb = ft.ScheduleBatch(
            ft.ForwardMode(int(mode)),
            t64(idx),
            torch.from_numpy(np.asarray(ids, np.int32).copy()),
            torch.from_numpy(np.asarray(lens, np.int32).copy()),
            None if draft_idx is None else ft.DraftInput(t64(draft_idx)),
        )
        self.tm.resolve(tb)
        j_ids, j_lens = np.asarray(res.input_ids)[:t], np.asarray(res.seq_lens)[:n]
        if self.fm.spec is None:
            assert j_ids.tobytes() == tensor_bytes(tb.input_ids.to(torch.int32))
        if mode == fj.ForwardMode.DECODE:
            assert j_lens.tobytes() == tensor_bytes(tb.seq_lens.to(torch.int32))
        draft = None
        if draft_idx is not None:
            m = len(draft_idx)
            jd, td = res.draft, tb.draft.payload
            draft = tuple(jax_bytes(np.asarray(x)[:m]) for x in jd if x is not None)
            tdraft = tuple(
                tensor_bytes(x)
                for x in (
                    td.bonus_tokens.to(torch.int32),
                    td.topk_p,
                    td.topk_index,
                    td.hidden_states,
                )
                if x is not None
            )
            assert draft == tdraft, "gathered draft differs"
        return j_ids, j_lens, draft

    def publish(self, idx: np.ndarray, lens: np.ndarray) -> None:
        self.fm.publish(idx, lens)
        self.tm.publish(t64(idx), t64(lens))

    def stash_tokens(self, idx: np.ndarray, tokens: np.ndarray) -> None:
        self.fm.stash(idx, tokens)
        self.tm.stash(t64(idx), t64(tokens))

    def stash_draft(self, idx: np.ndarray, rng: np.random.Generator, hdt: str | None) -> None:
        n = len(idx)
        bonus = rng.integers(0, 50, n)
        p_raw = special_floats((n, K), "f32", rng)
        topk = rng.integers(0, 1000, (n, K))
        h_raw = None if hdt is None else special_floats((n, H), hdt, rng)
        self.fm.stash(
            idx,
            fj.DraftPayload(
                bonus.astype(np.int32),
                as_jax_floats(p_raw, "f32"),
                topk.astype(np.int32),
                None if h_raw is None else as_jax_floats(h_raw, hdt),
            ),
        )
        self.tm.stash(
            t64(idx),
            ft.DraftPayload(
                t64(bonus),
                as_torch_floats(p_raw, "f32"),
                t64(topk),
                None if h_raw is None else as_torch_floats(h_raw, hdt),
            ),
        )


@pytest.mark.parametrize("debug", [False, True], ids=["prod", "debug"])
def test_nonspec_overlap_loop_matches_torch(debug: bool) -> None:
    """A non-spec overlap loop with EXTEND, DECODE, MIXED and IDLE batches, admissions,
    retirements and slot reuse must give fm_torch's resolved ids and lengths and buffers
    (slots 1..R-1) byte for byte; the resolved values must also match the host's record."""
    rng = np.random.default_rng(7 + debug)
    fm = fj.FutureMap(R, debug=debug, batch_buckets=BATCH_BUCKETS, token_buckets=TOKEN_BUCKETS)
    tm = ft.FutureMap(R, dtype=torch.int32, debug=debug)
    d = Driver(fm, tm)
    free = list(range(1, R))
    running: dict[int, tuple[int, int]] = {}  # slot -> (last token, seq len) the host expects
    kinds = set()
    for step in range(40):
        new = []
        if free and (not running or rng.random() < 0.4):
            for _ in range(int(rng.integers(1, 3))):
                if free:
                    new.append(free.pop(int(rng.integers(len(free)))))
        dec = [s for s in running if rng.random() < 0.8]
        if step % 9 == 8:  # an idle DP rank
            new, dec = [], []
            free.extend(s for s in [] if s)
        prompts = {s: rng.integers(0, 50, int(rng.integers(1, 4))) for s in new}
        idx = np.array(new + dec, np.int64)
        ids = np.concatenate([prompts[s] for s in new] + [np.array([-s]) for s in dec] + [[]])
        if new and dec:
            mode = fj.ForwardMode.MIXED
            lens = np.array([len(prompts[s]) for s in new] + [running[s][1] for s in dec])
        elif new:
            mode = fj.ForwardMode.EXTEND
            lens = np.array([len(prompts[s]) for s in new])
        elif dec:
            mode, lens = fj.ForwardMode.DECODE, -idx
        else:
            mode, lens = fj.ForwardMode.IDLE, np.zeros(0, np.int64)
        kinds.add(mode)
        ids = ids.astype(np.int64)
        r_ids, r_lens, _ = d.resolve(mode, idx, ids, lens)
        # The decode rows' ids and (DECODE) lengths are what the host expects.
        tail = r_ids[len(r_ids) - len(dec) :] if dec else r_ids[:0]
        assert tail.tolist() == [running[s][0] for s in dec]
        if mode == fj.ForwardMode.DECODE:
            assert r_lens.tolist() == [running[s][1] for s in dec]
        # forward: sample one token per row (0 included), lengths + 1
        tokens = rng.integers(0, 50, len(idx))
        new_lens = np.asarray(r_lens, np.int64) + 1
        d.publish(idx, new_lens)
        d.stash_tokens(idx, tokens)
        for s, tok, ln in zip(idx.tolist(), tokens.tolist(), new_lens.tolist(), strict=True):
            running[s] = (tok, ln)
        for s in list(running):
            if rng.random() < 0.15:  # retire; the slot may go to a new request at once
                del running[s]
                free.append(s)
        assert_buffers_match(fm, tm, step)
    fm.check()
    assert kinds == set(fj.ForwardMode), kinds


@pytest.mark.parametrize("hdt", [None, "bf16", "f16", "f32"])
def test_spec_overlap_loop_matches_torch(hdt: str | None) -> None:
    """A spec (EAGLE-like) loop with variable accept lengths must gather the same bonus
    tokens, top-k and hidden states as fm_torch, and keep the same buffers, byte for byte,
    with NaN payloads, -0.0 and inf in the float extras."""
    rng = np.random.default_rng(11)
    spec = fj.SpecConfig(topk=K, hidden=0 if hdt is None else H)
    if hdt is not None:
        spec = spec._replace(
            hidden_dtype=jnp.dtype(
                {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}[hdt]
            )
        )
    debug = hdt == "bf16"  # one spec case in debug mode (consume tracking on bonus tokens)
    fm = fj.FutureMap(
        R, spec=spec, debug=debug, batch_buckets=BATCH_BUCKETS, token_buckets=TOKEN_BUCKETS
    )
    tm = ft.FutureMap(R, dtype=torch.int32, spec=True, debug=debug)
    d = Driver(fm, tm)
    lens_host: dict[int, int] = {}
    free = list(range(1, R))
    for step in range(16):
        if free and (len(lens_host) < 2 or step % 4 == 0):  # admit: prefill, no draft input
            new = np.array([free.pop(0), free.pop(0)][: max(1, len(free))], np.int64)
            prompt = rng.integers(0, 50, 2 * len(new))
            plen = np.full(len(new), 2)
            d.resolve(fj.ForwardMode.EXTEND, new, prompt, plen)
            d.publish(new, plen + 1)
            d.stash_draft(new, rng, hdt)
            lens_host.update({s: 3 for s in new.tolist()})
        else:
            idx = np.array([s for s in lens_host if rng.random() < 0.85] or [next(iter(lens_host))])
            assert (fm.resolve_seq_lens_cpu(idx) == tm.resolve_seq_lens_cpu(t64(idx)).numpy()).all()
            _, r_lens, _ = d.resolve(fj.ForwardMode.DECODE, idx, -idx, -idx, draft_idx=idx)
            assert r_lens.tolist() == [lens_host[s] for s in idx.tolist()]
            accept = rng.integers(1, 4, len(idx))
            d.publish(idx, r_lens + accept)
            d.stash_draft(idx, rng, hdt)
            for s, ln in zip(idx.tolist(), (r_lens + accept).tolist(), strict=True):
                lens_host[s] = ln
            if step % 5 == 3:  # retire one; its slot is reused by the next admission
                gone = idx[0].item()
                del lens_host[gone]
                free.append(gone)
        assert_buffers_match(fm, tm, step)
    fm.check()


def test_dlpack_export_gives_the_same_bytes() -> None:
    """Every buffer exported with torch.from_dlpack must hold the jax buffer's bytes."""
    spec = fj.SpecConfig(topk=K, hidden=H, hidden_dtype=jnp.dtype(jnp.bfloat16))
    fm = fj.FutureMap(R, spec=spec, batch_buckets=(4,), token_buckets=(4,))
    rng = np.random.default_rng(3)
    idx = np.array([1, 5, 7])
    fm.publish(idx, np.array([9, 8, 7]))
    h_raw = special_floats((3, H), "bf16", rng)
    fm.stash(
        idx,
        fj.DraftPayload(
            np.array([4, 0, 6], np.int32),
            as_jax_floats(special_floats((3, K), "f32", rng), "f32"),
            rng.integers(0, 99, (3, K)).astype(np.int32),
            as_jax_floats(h_raw, "bf16"),
        ),
    )
    bufs = fm.buffers()
    assert set(bufs) == {"output_tokens", "new_seq_lens", "topk_p", "topk_index", "hidden_states"}
    for name, buf in bufs.items():
        t = torch.from_dlpack(buf)
        assert tuple(t.shape) == buf.shape, name
        assert tensor_bytes(t) == jax_bytes(buf), name
        del t
    assert jax_bytes(bufs["hidden_states"][np.array([1, 5, 7])]) == h_raw.tobytes()
    # The map keeps working after the exports are released.
    del bufs
    fm.publish(np.array([2]), np.array([1]))
    assert int(fm.state.new_seq_lens[2]) == 1
