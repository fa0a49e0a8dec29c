"""fm_bench.in_flight: the probe's CLI writes its page and its JSON with every row, per
dispatch and load (tiny sizes; the figures themselves are not checked)."""

from __future__ import annotations

import json

from fm_bench import in_flight

SWEEP = (0.0, 10.0)


def test_cli_writes_every_row_for_every_dispatch_and_load(tmp_path):
    argv = ["--rows", "16", "--pool", "64", "--dim", "8", "--chain", "1", "--steps", "3"]
    argv += ["--runs", "1", "--sweep", "0,10", "--out", str(tmp_path), "--tag", "test"]
    assert in_flight.main(argv) == 0
    md = (tmp_path / "in_flight_test.md").read_text()
    doc = json.loads((tmp_path / "in_flight_test.json").read_text())

    names = in_flight.row_names(SWEEP)
    assert set(in_flight.ROWS) < set(names)
    assert in_flight.sweep_row(10.0) in names
    got = {(r["dispatch"], r["load"], r["row"]) for r in doc["rows"]}
    want = {(d, ld, n) for d in in_flight.DISPATCHES for ld in in_flight.LOADS for n in names}
    assert got == want
    for r in doc["rows"]:
        # Two virtual CPU devices in the child: every row ran, each once.
        assert r["runs"] == 1, r
        assert set(in_flight.FIGURES) & set(r) >= {"host_us", "cpu_us", "ready"}, r
    for name in names:
        assert f"| {name} |" in md
    for title in ("default async dispatch", "jax_cpu_enable_async_dispatch=False"):
        for ld in in_flight.LOADS:
            assert f"## {title}, background load: {ld}" in md
    assert doc["flops"]["cheap"] < in_flight.CHEAP_FLOPS  # the cheap rows' premise


def test_render_rewrites_the_page_from_the_json(tmp_path):
    out = tmp_path / "again"
    first = tmp_path / "first"
    argv = ["--rows", "16", "--pool", "64", "--dim", "8", "--chain", "1", "--steps", "3"]
    argv += ["--runs", "1", "--loads", "none", "--dispatch", "sync", "--sweep", "0"]
    assert in_flight.main([*argv, "--out", str(first)]) == 0
    rendered = ["--render", str(first / "in_flight_cpu.json"), "--out", str(out)]
    assert in_flight.main(rendered) == 0
    assert (out / "in_flight_cpu.md").read_text() == (first / "in_flight_cpu.md").read_text()
