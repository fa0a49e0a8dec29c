"""`fm-serve` and `fm-serve-bench` answer every bad argument with a usage error.

Exit status 2 (argparse's), the argument named on stderr, never a traceback and never the
status 1 that `--compare` (and the benchmark) give for "tokens differ". The checks that
need the model (a prompt's length in tokens) run after it loads: there the loader is a
reduced random Gemma with a character tokenizer, so no weights are needed.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from fm_serve.gemma import bench, cli, load
from fm_serve.gemma.config import GemmaConfig

TINY = GemmaConfig(
    vocab=512, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128
)


class CharTokenizer:
    """One token per character (ids 3..), `<bos>` = 2: enough for length checks."""

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return ([2] if add_bos is not False else []) + [3 + ord(c) % 500 for c in text]

    def decode(self, ids: Any, skip_special: bool = False) -> str:
        return "".join(chr(i - 3) for i in ids if i >= 3)


def _fake_load(**kwargs: Any) -> load.Loaded:
    got = load.random_model(max_seq_len=kwargs.get("max_seq_len", 64), row_tile=4, config=TINY)
    return load.Loaded(got.model, got.params, CharTokenizer(), False, 0.0, None)  # type: ignore[arg-type]


def _usage_error(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err and "usage:" in err
    return err


SERVE_CASES = [
    (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file"),
    (["--max-seq-len", "0"], "--max-seq-len"),
    (["--max-seq-len", "-4"], "--max-seq-len"),
    (["--max-tokens", "600"], "--max-tokens"),  # longer than the default --max-seq-len 512
    (["--max-tokens", "-3"], "--max-tokens"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--max-running", "0"], "--max-running"),
    (["--prefill-budget", "0"], "--prefill-budget"),
    (["--seed", "-1"], "--seed"),
    (["--top-k", "-1"], "--top-k"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--presence-penalty", "2.5"], "--presence-penalty"),
    (["--frequency-penalty", "-3"], "--frequency-penalty"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--logprobs", "-1"], "--logprobs"),
    (["--logprobs", "21"], "--logprobs"),
    (["--bad-words", ""], "--bad-words"),
    (["--stop", ""], "--stop"),
    (["--kv-budget", "0"], "--kv-budget"),
    (["--stream", "--compare"], "--stream"),
]


@pytest.mark.parametrize(("argv", "named"), SERVE_CASES, ids=[" ".join(c[0]) for c in SERVE_CASES])
def test_fm_serve_refuses_a_bad_argument_before_loading(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """Pins a bad fm-serve argument ending in a traceback, served silently (a negative
    temperature served greedy), or reported with the 'tokens differ' status."""

    def no_load(**kwargs: Any) -> None:
        raise AssertionError("the model was loaded for a bad argument")

    monkeypatch.setattr(load, "load_model", no_load)
    assert f"argument {named}" in _usage_error(cli.main, argv, capsys)


def test_fm_serve_reads_a_prompts_file_and_refuses_an_empty_one(tmp_path: Path) -> None:
    """Pins the usage check refusing a good file (and an empty file served as the default)."""
    good = tmp_path / "p.txt"
    good.write_text("one\n\ntwo\\nlines\n")
    assert cli.parse_args(["--prompts-file", str(good)]).prompt == ["one", "two\nlines"]
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--prompts-file", str(tmp_path / "empty.txt")])
    assert info.value.code == 2


AFTER_LOAD = [
    (["--max-seq-len", "16", "--max-tokens", "4", "--prompt", "x" * 14], "--max-seq-len"),
    (["--kv-budget", "10", "--max-tokens", "4", "--prompt", "x" * 8], "--kv-budget"),
    (["--bad-words", "y" * 9], "--bad-words"),
    (["--top-k", "513"], "--top-k"),
]


@pytest.mark.parametrize(("argv", "named"), AFTER_LOAD, ids=[c[1] for c in AFTER_LOAD])
def test_fm_serve_refuses_what_the_model_cannot_serve(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """Pins a prompt longer than --max-seq-len (or the KV budget), a bad word longer than
    the engine holds, or --top-k beyond the vocabulary, ending in a traceback after load."""
    monkeypatch.setattr(load, "load_model", _fake_load)
    err = _usage_error(cli.main, ["--no-compile-cache", *argv], capsys)
    assert f"argument {named}" in err


BENCH_CASES = [
    (["--row-tile", "0"], "--row-tile"),
    (["--repeats", "0"], "--repeats"),
    (["--repeats", "2"], "--repeats"),
    (["--max-tokens", "-3"], "--max-tokens"),
    (["--max-tokens", "200"], "--max-tokens"),  # >= the default --max-seq-len 128
    (["--ratios", "-1"], "--ratios"),
    (["--ratios", "0,nan"], "--ratios"),
    (["--ratios", "a"], "--ratios"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--batch-sizes", ""], "--batch-sizes"),
    (["--batch-sizes", "4,x"], "--batch-sizes"),
    (["--max-seq-len", "0"], "--max-seq-len"),
    (["--prefill-budget", "0"], "--prefill-budget"),
    (["--matrix", "--costs"], "--matrix"),
]


@pytest.mark.parametrize(("argv", "named"), BENCH_CASES, ids=[" ".join(c[0]) for c in BENCH_CASES])
def test_fm_serve_bench_refuses_a_bad_argument_before_measuring(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """Pins a bad fm-serve-bench argument ending in a traceback (after a measurement has
    run, for --ratios), measuring nothing with status 0 (--batch-sizes ''), or named as a
    pool size the user never gave (--batch-sizes 0)."""

    def no_load(**kwargs: Any) -> None:
        raise AssertionError("the model was loaded for a bad argument")

    monkeypatch.setattr(load, "load_model", no_load)
    monkeypatch.setattr(load, "random_model", no_load)
    assert f"argument {named}" in _usage_error(bench.main, ["--random-weights", *argv], capsys)


def test_fm_serve_bench_refuses_prompts_longer_than_the_cache(
    capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """Pins a prompt + --max-tokens past --max-seq-len ending in a traceback after load."""
    monkeypatch.setattr(load, "random_model", functools.partial(load.random_model, config=TINY))
    argv = ["--random-weights", "--batch-sizes", "2", "--max-seq-len", "20", "--max-tokens", "4"]
    assert "argument --max-seq-len" in _usage_error(bench.main, argv, capsys)


@pytest.mark.slow  # three loops' warm-up with every feature: a minute or more on 2 cores
def test_fm_serve_serves_every_sampling_setting_the_same_in_every_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    """Pins a sampling flag parsed but not served (or served differently by the overlap
    loops): penalties, a bad word, logprobs, a stop string and a KV budget that preempts,
    served by sync, overlap and debug overlap alike (reduced random Gemma)."""
    monkeypatch.setattr(load, "load_model", _fake_load)
    doc = tmp_path / "run.json"
    argv = ["--no-compile-cache", "--compare", "--max-tokens", "6", "--max-running", "2"]
    argv += ["--prompt", "hello there", "--prompt", "a longer prompt, chunked", "--prompt", "x"]
    argv += ["--presence-penalty", "-1", "--repetition-penalty", "1.3", "--bad-words", "ab"]
    argv += ["--logprobs", "2", "--stop", "zz", "--kv-budget", "40", "--prefill-budget", "8"]
    argv += ["--json", str(doc)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "tokens identical across overlap, sync, debug: yes" in out
    got = json.loads(doc.read_text())
    assert got["tokens_equal"]
    runs = got["runs"]
    assert [len(lp) for lp in runs["overlap"]["logprobs"]] == [
        len(o) for o in runs["overlap"]["outputs"]
    ]
    assert all(r["retractions"] > 0 for r in runs.values())


def test_fm_serve_streams_each_token(capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> None:
    """Pins --stream printing nothing until the run ends (or tokens the completion lacks)."""
    monkeypatch.setattr(load, "load_model", _fake_load)
    argv = ["--no-compile-cache", "--stream", "--mode", "sync", "--max-tokens", "3"]
    assert cli.main([*argv, "--prompt", "hi"]) == 0
    out = capsys.readouterr().out
    streamed, completion = out.split("--- [0] 'hi'\n")
    assert streamed.count("[0]'") == 3
    assert completion.splitlines()[0]
