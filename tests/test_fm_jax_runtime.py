"""The map's runtime (fm_jax/map/runtime.py) met directly: which optional relayed fields a
stash has carried, per DP rank."""

from __future__ import annotations

from fm_jax.map.runtime import MapRuntime, Rows


def test_a_field_is_relayed_per_rank_once_a_stash_there_carried_it() -> None:
    """Per DP rank, as each SGLang rank's own map makes its buffers: a stash with no row on
    a rank (its count 0) relays nothing there; a field left out stays unrelayed; once
    every rank has every optional field the record is dropped (one check per call)."""
    rt = MapRuntime(lambda: None, None, None, None, optional=("topk_p", "dsa"), dp=2)  # type: ignore[arg-type]
    rt.stashed(Rows(None, 2, (2, 0), True), ("dsa",))
    assert rt.relayed(0) == ("topk_p",) and rt.relayed(1) == ()
    rt.stashed(Rows(None, 2, (0, 1), True), ())
    assert rt.relayed(1) == ("topk_p", "dsa") and rt.unstashed is not None
    rt.stashed(Rows(None, 2, None, False), ())  # jax-array slots: every rank
    assert rt.unstashed is None and rt.relayed(0) == ("topk_p", "dsa")
    rt.reset()
    assert rt.relayed(0) == rt.relayed(1) == ()
