"""fm_torch: engine-owned relay buffers (SGLang's FutureRelayBuffers: adopted at
construction, publish and stash skip the write the engine already made) and the one-row
path of resolve (a batch of one reads its row's slice, no gather)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fm_torch as ft

D = ft.ForwardMode.DECODE
t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


def _relay(r: int = 6, dtype: torch.dtype = torch.int64) -> ft.RelayBuffers:
    return ft.RelayBuffers(torch.full((r,), 9, dtype=dtype), torch.full((r,), 9, dtype=dtype))


@pytest.mark.parametrize("debug", [False, True])
def test_the_map_adopts_the_engine_s_buffers_with_its_initial_contents(debug: bool) -> None:
    relay = _relay()
    fm = ft.FutureMap(6, relay=relay, debug=debug)
    assert fm.new_seq_lens is relay.new_seq_lens and fm.output_tokens is relay.output_tokens
    assert relay.adopted and relay.new_seq_lens.tolist() == [-1 if debug else 0] * 6
    assert relay.output_tokens.tolist() == [ft.POISON if debug else 0] * 6


def test_publish_and_stash_skip_the_rows_the_engine_wrote() -> None:
    relay = _relay()
    fm = ft.FutureMap(6, relay=relay)
    lens, tokens = t(4, 5), t(7, 8)
    relay.new_seq_lens[t(1, 2)] = t(40, 50)  # what the engine's graph wrote (told apart here)
    relay.output_tokens[t(1, 2)] = t(70, 80)
    relay.published_seq_lens, relay.published_bonus = lens, tokens
    fm.publish(t(1, 2), lens)
    fm.stash(t(1, 2), tokens)
    assert fm.new_seq_lens[1:3].tolist() == [40, 50] and fm.output_tokens[1:3].tolist() == [70, 80]
    assert relay.published_seq_lens is None and relay.published_bonus is None
    fm.publish(t(1, 2), lens)  # the mark is spent: the same tensor is written now
    fm.stash(t(1, 2), t(7, 8))  # an equal tensor that is not the marked one is written
    assert fm.new_seq_lens[1:3].tolist() == [4, 5] and fm.output_tokens[1:3].tolist() == [7, 8]


def test_a_spec_stash_skips_only_the_bonus_tokens_the_engine_wrote() -> None:
    relay = _relay()
    fm = ft.FutureMap(6, relay=relay, spec=True)
    bonus = t(3, 4)
    relay.output_tokens[t(1, 2)] = t(30, 40)
    relay.published_bonus = bonus
    fm.stash(t(1, 2), ft.DraftPayload(bonus, torch.ones(2, 2), t(5, 6, 7, 8).reshape(2, 2)))
    assert fm.output_tokens[1:3].tolist() == [30, 40]
    assert fm.topk_index is not None and fm.topk_index[1:3].tolist() == [[5, 6], [7, 8]]


def test_bad_relay_buffers_are_refused_by_name() -> None:
    with pytest.raises(ft.FutureMapError, match="relay.new_seq_lens"):
        ft.FutureMap(6, relay=_relay(5))
    with pytest.raises(ft.FutureMapError, match="relay.output_tokens"):
        ft.FutureMap(6, relay=ft.RelayBuffers(torch.zeros(6, dtype=torch.int64), torch.zeros(6)))
    with pytest.raises(ft.FutureMapError, match="share memory"):
        buf = torch.zeros(6, dtype=torch.int64)
        ft.FutureMap(6, relay=ft.RelayBuffers(buf, buf))
    relay = _relay()
    ft.FutureMap(6, relay=relay)
    with pytest.raises(ft.FutureMapError, match="already adopted"):
        ft.FutureMap(6, relay=relay)


class _Gathers(TorchDispatchMode):
    """The gathers (aten.index, index_select) run inside it from one of `buffers`."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {b.data_ptr() for b in buffers}
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if name in ("aten.index", "aten.index_select") and args[0].data_ptr() in self.ptrs:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _resolved(rows: int, protocol: str, spec: bool) -> tuple[ft.ScheduleBatch, list[str]]:
    """A DECODE of `rows` rows resolved after a prefill of slots 1..rows; its gathers."""
    fm = ft.FutureMap(6, protocol=protocol, spec=spec)
    slots = torch.arange(1, rows + 1)
    fm.publish(slots, slots + 10)
    if spec:
        topk = torch.arange(2 * rows, dtype=torch.float32).reshape(rows, 2)
        fm.stash(slots, ft.DraftPayload(slots + 20, topk, topk.long(), topk.bfloat16()))
    else:
        fm.stash(slots, slots + 20)
    ids = -slots if protocol == "sentinel" else (slots if spec else None)
    draft = ft.DraftInput(slots) if spec else None
    batch = ft.ScheduleBatch(D, slots, ids, -slots if protocol == "sentinel" else slots, draft)
    bufs = [fm.output_tokens, fm.new_seq_lens]
    bufs += [b for b in (fm.topk_p, fm.topk_index, fm.hidden_states) if b is not None]
    with _Gathers(bufs) as gathers:
        fm.resolve(batch)
    return batch, gathers.seen


@pytest.mark.parametrize(
    ("protocol", "spec"), [("sentinel", False), ("gather", False), ("gather", True)]
)
def test_a_one_row_resolve_reads_slices_with_the_bytes_of_a_gather(
    protocol: str, spec: bool
) -> None:
    one, gathers = _resolved(1, protocol, spec)
    two, _ = _resolved(2, protocol, spec)
    assert gathers == []
    assert one.input_ids is not None and two.input_ids is not None
    assert one.input_ids.tolist() == two.input_ids[:1].tolist()
    assert one.seq_lens.tolist() == two.seq_lens[:1].tolist()
    if spec:
        assert one.draft is not None and two.draft is not None
        a, b = one.draft.payload, two.draft.payload
        assert a is not None and b is not None
        for name in ("bonus_tokens", "topk_p", "topk_index", "hidden_states"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype, name
            assert (
                x.numpy().tobytes() == y[:1].numpy().tobytes()
                if x.dtype != torch.bfloat16
                else (torch.equal(x.view(torch.int16), y[:1].view(torch.int16)))
            ), name
