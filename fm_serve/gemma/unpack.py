"""Unpacking a Gemma 3 GGUF into the cache: dequantized weights, config and tokenizer tables.

The first start reads the GGUF with `gguf` (its reader parses every metadata array, about
10 s for the 262,144-piece vocabulary on a 2-core CPU) and dequantizes every tensor in numpy;
later starts read the unpacked directory only: a JSON config, a JSON tokenizer table and one
.npy file per weight array, loaded without `gguf`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fm_serve.gemma.config import GemmaConfig, config_from_metadata
from fm_serve.gemma.params import GGUF_BLOCK_NAMES, MATRICES, Blocks, GemmaParams
from fm_serve.gemma.tokenizer import TokenizerTables

CONFIG_FILE = "config.json"  # written last: its presence marks a complete directory
TOKENIZER_FILE = "tokenizer.json"


def _metadata(reader: Any) -> dict[str, Any]:
    """The scalar metadata of a GGUF (arrays of the tokenizer are read separately)."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"}
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def _tokenizer_tables(reader: Any, meta: dict[str, Any]) -> TokenizerTables:
    def special(key: str) -> int:
        return int(meta[f"tokenizer.ggml.{key}_token_id"])

    return TokenizerTables(
        tokens=list(reader.fields["tokenizer.ggml.tokens"].contents()),
        types=[int(t) for t in reader.fields["tokenizer.ggml.token_type"].contents()],
        bos_id=special("bos"),
        eos_id=special("eos"),
        unk_id=special("unknown"),
        pad_id=special("padding"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
    )


def _weights(reader: Any, cfg: GemmaConfig) -> GemmaParams:
    """Every tensor dequantized to float32 and arranged as `GemmaParams` (numpy)."""
    from gguf.quants import dequantize

    by_name = {t.name: t for t in reader.tensors}

    def tensor(name: str) -> np.ndarray:
        t = by_name[name]
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    def stacked(field: str) -> np.ndarray:
        parts = [tensor(f"blk.{i}.{GGUF_BLOCK_NAMES[field]}.weight") for i in range(cfg.n_layers)]
        if field in MATRICES:
            parts = [p.T for p in parts]
        return np.ascontiguousarray(np.stack(parts))

    blocks = Blocks(**{f: stacked(f) for f in Blocks._fields})
    return GemmaParams(
        embed=tensor("token_embd.weight"),
        blocks=blocks,
        final_norm=tensor("output_norm.weight"),
    )


def _check_shapes(cfg: GemmaConfig, p: GemmaParams) -> None:
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    want = {
        "embed": (cfg.vocab, d),
        "wq": (cfg.n_layers, d, cfg.n_heads * hd),
        "wk": (cfg.n_layers, d, cfg.n_kv_heads * hd),
        "wo": (cfg.n_layers, cfg.n_heads * hd, d),
        "w_down": (cfg.n_layers, f, d),
        "q_norm": (cfg.n_layers, hd),
    }
    got = {"embed": p.embed.shape, **{k: getattr(p.blocks, k).shape for k in want if k != "embed"}}
    bad = {k: (got[k], v) for k, v in want.items() if tuple(got[k]) != v}
    if bad:
        raise ValueError(f"GGUF tensors do not match its metadata (got, expected): {bad}")


def unpack_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Read `gguf_path` and write its unpacked form to `out_dir` (atomically replaced)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    tables = _tokenizer_tables(reader, meta)
    cfg = config_from_metadata(meta, vocab=len(tables.tokens))
    params = _weights(reader, cfg)
    _check_shapes(cfg, params)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        np.save(tmp / "embed.npy", params.embed)
        np.save(tmp / "final_norm.npy", params.final_norm)
        for name, arr in params.blocks._asdict().items():
            np.save(tmp / f"{name}.npy", arr)
        (tmp / TOKENIZER_FILE).write_text(json.dumps(tables._asdict(), ensure_ascii=False))
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg._asdict(), indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_unpacked(out_dir: Path) -> bool:
    """Whether `out_dir` holds a complete unpacked model."""
    return (out_dir / CONFIG_FILE).is_file()


def read_unpacked(out_dir: Path) -> tuple[GemmaConfig, GemmaParams, TokenizerTables]:
    """The config, the numpy weights (memory-mapped) and the tokenizer tables of `out_dir`."""
    cfg = GemmaConfig(**json.loads((out_dir / CONFIG_FILE).read_text()))
    tables = TokenizerTables(**json.loads((out_dir / TOKENIZER_FILE).read_text()))

    def arr(name: str) -> np.ndarray:
        return np.load(out_dir / f"{name}.npy", mmap_mode="r")

    blocks = Blocks(**{f: arr(f) for f in Blocks._fields})
    return cfg, GemmaParams(arr("embed"), blocks, arr("final_norm")), tables
