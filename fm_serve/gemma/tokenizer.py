"""Gemma's tokenizer, built from a GGUF's vocabulary as transformers builds it.

The GGUF stores SentencePiece pieces with their token types and no merges. transformers
(>= 5) reads such a file as a byte-fallback BPE whose merges are every split of a piece into
two pieces, ranked by the merged piece's place in the vocabulary (earlier first), then by the
longer left part. Encoding:
  1. added tokens are cut out of the raw text whole, leftmost and longest first: control
     tokens (`<bos>`, `<start_of_turn>`, ...) and user-defined ones (newline and tab runs,
     HTML tags) whose piece is spelled as the text spells it;
  2. each remaining span has its spaces written as U+2581 and is one BPE word: its
     characters (a character outside the vocabulary as its UTF-8 byte pieces `<0xHH>`)
     merged pairwise, best-ranked pair first, leftmost among equals;
  3. `<bos>` goes first when the file says so.
Pieces that are runs of real spaces are respelled as runs of U+2581 first (as the BPE sees
spaces). Decoding writes U+2581 as a space and joins runs of byte pieces into UTF-8 (each
byte of an invalid run becomes U+FFFD).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import NamedTuple

SPACE = "\u2581"
CONTROL, USER_DEFINED = 3, 4  # SentencePiece token types, as the GGUF stores them


class TokenizerTables(NamedTuple):
    """A GGUF's tokenizer metadata: pieces, their types and the special ids."""

    tokens: list[str]
    types: list[int]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    add_bos: bool


def _respell(piece: str) -> str:
    """A piece of real spaces only, as BPE spells it (one U+2581 per space)."""
    return SPACE * len(piece) if " " in piece and not piece.strip() else piece


def _byte_piece(b: int) -> str:
    return f"<0x{b:02X}>"


class Tokenizer:
    """Encode text to token ids and decode ids to text (see the module docstring)."""

    def __init__(self, tables: TokenizerTables) -> None:
        self.tables = tables
        self.pieces = [_respell(t) for t in tables.tokens]
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.special = frozenset(i for i, t in enumerate(tables.types) if t == CONTROL)
        added = {
            tok: self.ids[tok]
            for tok, kind in zip(tables.tokens, tables.types, strict=True)
            if kind == CONTROL or (kind == USER_DEFINED and tok in self.ids)
        }
        self._added = added
        lengths: dict[str, set[int]] = {}
        for tok in added:
            lengths.setdefault(tok[0], set()).add(len(tok))
        self._added_lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}

    @property
    def vocab(self) -> int:
        """Number of pieces."""
        return len(self.pieces)

    @property
    def bos_id(self) -> int:
        """The beginning-of-sequence id."""
        return self.tables.bos_id

    @property
    def eos_id(self) -> int:
        """The end-of-sequence id."""
        return self.tables.eos_id

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; `<bos>` first when `add_bos` (default: the file's flag)."""
        bos = self.tables.add_bos if add_bos is None else add_bos
        ids = [self.tables.bos_id] if bos else []
        for span, added in self._split_added(text):
            if added is not None:
                ids.append(added)
            else:
                ids.extend(self._bpe(span.replace(" ", SPACE)))
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`; control tokens left out when `skip_special`."""
        out: list[str] = []
        run = bytearray()

        def flush() -> None:
            if run:
                try:
                    out.append(run.decode("utf-8"))
                except UnicodeDecodeError:
                    out.append("\ufffd" * len(run))
                run.clear()

        for i in ids:
            if skip_special and i in self.special:
                continue
            piece = self.pieces[i]
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    run.append(int(piece[3:5], 16))
                    continue
                except ValueError:
                    pass
            flush()
            out.append(piece.replace(SPACE, " "))
        flush()
        return "".join(out)

    def _split_added(self, text: str) -> Iterator[tuple[str, int | None]]:
        """Spans of `text`: (added token, its id) or (plain text, None), in order."""
        start = i = 0
        n = len(text)
        while i < n:
            hit = None
            for length in self._added_lengths.get(text[i], ()):
                tok = text[i : i + length]
                if tok in self._added:
                    hit = tok
                    break
            if hit is None:
                i += 1
                continue
            if start < i:
                yield text[start:i], None
            yield hit, self._added[hit]
            i += len(hit)
            start = i
        if start < n:
            yield text[start:], None

    def _bpe(self, word: str) -> list[int]:
        """One word's ids: characters (or their byte pieces) merged best rank first."""
        syms: list[str] = []
        for ch in word:
            if ch in self.ids:
                syms.append(ch)
            else:
                syms.extend(_byte_piece(b) for b in ch.encode("utf-8"))
        n = len(syms)
        if n == 0:
            return []
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        alive = [True] * n
        # (merged piece's id, -len(left), left position, left, right): the merge order
        heap: list[tuple[int, int, int, str, str]] = []

        def push(i: int) -> None:
            j = nxt[i]
            if j >= 0:
                merged = self.ids.get(syms[i] + syms[j])
                if merged is not None:
                    heapq.heappush(heap, (merged, -len(syms[i]), i, syms[i], syms[j]))

        for i in range(n - 1):
            push(i)
        while heap:
            _, _, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            if not alive[i] or j < 0 or syms[i] != left or syms[j] != right:
                continue  # stale: a neighbour merged since this pair was queued
            syms[i] = left + right
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] >= 0:
                prev[nxt[j]] = i
            if prev[i] >= 0:
                push(prev[i])
            push(i)
        return [self.ids[s] for s, keep in zip(syms, alive, strict=True) if keep]
