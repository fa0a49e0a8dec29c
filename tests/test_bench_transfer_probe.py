"""fm_bench.transfer_probe: every way in computes the same sum, and the CLI writes its JSON."""

from __future__ import annotations

import json

import numpy as np

from fm_bench import transfer_probe


def test_every_way_in_gives_the_same_sum():
    """The five series feed the same k arrays: each result equals numpy's sum, so a
    series that dropped or mis-split an input would show."""
    k, batch = 4, 16
    rng = np.random.default_rng(0)
    want = sum(rng.integers(0, 1 << 20, batch, dtype=np.int32) for _ in range(k))
    got = {}
    for s in transfer_probe.series(k, batch):
        got[s.key] = np.asarray(s.run())
    assert len(got) == 5
    for key, value in got.items():
        np.testing.assert_array_equal(value, want, err_msg=str(key))


def test_cli_writes_one_median_per_series(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert (
        transfer_probe.main(["--arrays", "2", "--batch", "8", "--reps", "3", "--json", str(out)])
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["arrays"] == 2 and len(doc["series"]) == 5
    assert all(v["median_us"] > 0 for v in doc["series"].values())
    assert "jax arrays already on the device" in capsys.readouterr().out
