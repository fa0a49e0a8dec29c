"""Structured output: a regex or JSON-schema constraint per request, compiled with llguidance.

A request's `Grammar` is compiled once, when a run starts, into an llguidance matcher over
the model's vocabulary (`GrammarTokenizer`: the token byte strings of fm_serve's own
tokenizer tables, never transformers'). Before each sampling of the request's row the host
computes the matcher's token mask (a bitmask [ceil(V / 32)] int32, bit v of word v // 32:
token v allowed), the step keeps only allowed logits, and the host then advances the
matcher with the token it reads back.

The mask for step N + 1 needs step N's token, which the overlap loop reads only after
dispatching N + 1. The engine therefore splits a step whose batch has a constrained row
(`Engine`, the split step): the relay's resolve and the forward are dispatched first; the
host then reads step N's tokens, advances the matchers, builds the masks, and dispatches
the sampling with the masks and the relay's tail (`FutureMap.finish`). The forward of
N + 1 runs on the device while the host does that work. A batch with no constrained row
runs the fused step: a request without a grammar pays nothing. With speculative
decoding the split is the same, with a mask per verified position (`spec`).

Finishing: a matcher that has stopped (the grammar is complete, its end token consumed)
finishes the request ("grammar complete"); a mask that allows no token finishes it
("grammar dead end"), and the others go on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

LLGUIDANCE_MISSING = (
    "structured output needs llguidance (pip install 'fm-jax[grammar]', or pip install llguidance)"
)


DEAD_END = "grammar dead end: no token can continue the output"
"""The reason a request ends when its grammar allows no token next."""


def llguidance_available() -> bool:
    """Whether llguidance imports."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Grammar:
    """A request's output constraint.

    Attributes:
      kind: "regex" (the whole output matches it) or "json_schema" (the output is
        compact JSON valid under the schema, `source` its JSON text).
      source: the regex or the schema's JSON text.
    """

    kind: str
    source: str

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's form; ValueError naming what is wrong."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return str(LLMatcher.grammar_from_regex(self.source))
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as err:
                raise ValueError(f"JSON schema is not JSON: {err}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"JSON schema must be an object, got {type(schema).__name__}")
            # Compact JSON (no whitespace between tokens): what a constrained output
            # needs, and no budget lost to runs of spaces.
            return str(
                LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
            )
        raise ValueError(f"grammar kind must be 'regex' or 'json_schema', got {self.kind!r}")


@dataclass
class GrammarTokenizer:
    """What llguidance needs of a vocabulary (its `TokenizerWrapper` interface).

    Attributes:
      tokens: each id's bytes; a special token is 0xFF then its name (llguidance's rule:
        such bytes never occur in text, so the grammar never allows one but the end token).
      eos_token_id: the token that ends a constrained output.
      encode: text bytes -> ids (llguidance tokenizes forced text with it).
    """

    tokens: list[bytes]
    eos_token_id: int
    encode: Callable[[bytes], list[int]]
    bos_token_id: int | None = None
    special_token_ids: Sequence[int] = ()

    def __call__(self, text: str | bytes) -> list[int]:
        """The ids of `text` (llguidance passes a str)."""
        return self.encode(text.encode() if isinstance(text, str) else text)

    def llguidance(self) -> Any:
        """The llguidance tokenizer (`LLTokenizer`) over these tables."""
        import llguidance

        self.is_tokenizer_wrapper = True
        return llguidance.LLTokenizer(self, n_vocab=len(self.tokens))  # type: ignore[arg-type]


def gemma_tokenizer(tok: Any, eos_id: int) -> GrammarTokenizer:
    """The grammar tokenizer of fm_serve's Gemma tokenizer (`gemma.tokenizer.Tokenizer`):
    a piece's spaces (U+2581) as spaces, byte pieces `<0xHH>` as their byte, control
    tokens special; `eos_id` ends a constrained output (Gemma's end of turn)."""
    from fm_serve.gemma.tokenizer import SPACE

    out = []
    for i, piece in enumerate(tok.pieces):
        if i in tok.special:
            out.append(b"\xff" + piece.encode())
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace(SPACE, " ").encode())
    return GrammarTokenizer(
        out,
        eos_id,
        lambda b: tok.encode(b.decode("utf-8", "replace"), add_bos=False),
        bos_token_id=tok.bos_id,
        special_token_ids=sorted(tok.special),
    )


def toy_tokenizer(vocab: int, eos_id: int) -> GrammarTokenizer:
    """A byte vocabulary for the toy model: id 2 + b is the byte b (b < 256); ids 0 (pad),
    `eos_id` and those past 257 are special."""
    out = []
    for i in range(vocab):
        b = i - 2
        out.append(bytes([b]) if 0 <= b < 256 and i != eos_id else b"\xff<t%d>" % i)

    def encode(text: bytes) -> list[int]:
        return [2 + b for b in text]

    special = [i for i in range(vocab) if not 2 <= i < 258 or i == eos_id]
    return GrammarTokenizer(out, eos_id, encode, special_token_ids=special)


def toy_decode(ids: Sequence[int]) -> str:
    """The text of toy-model ids (`toy_tokenizer`), special ids left out."""
    return bytes(i - 2 for i in ids if 2 <= i < 258).decode("utf-8", "replace")


class Matchers:
    """The constrained requests' matchers of one run, over one llguidance tokenizer.

    Args:
      tokenizer: the vocabulary (`gemma_tokenizer`, `toy_tokenizer`).
      vocab: V, the model's logits width (masks are [ceil(V / 32)] words).
    """

    def __init__(self, tokenizer: GrammarTokenizer, vocab: int) -> None:
        self.ll_tokenizer = tokenizer.llguidance()
        self.vocab = vocab
        self.words = (vocab + 31) // 32

    def compile(self, grammar: Grammar) -> Any:
        """A fresh matcher; ValueError with llguidance's message when it does not compile."""
        from llguidance import LLMatcher

        text = grammar.llguidance_grammar()
        m = LLMatcher(self.ll_tokenizer, text, log_level=0)
        if m.is_error():
            raise ValueError(f"{grammar.kind} does not compile: {m.get_error()}")
        return m

    def fill(self, matcher: Any, row: np.ndarray) -> str:
        """Write the matcher's mask into `row` ([words] int32, contiguous); returns why
        no token can follow ("" when some can)."""
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)
        error = matcher.get_error() if matcher.is_error() else ""
        stuck = matcher.stop_reason() in ("NoExtension", "NoExtensionBias")
        if stuck or "NoExtension" in error or not row.any():
            return DEAD_END
        if error:
            return f"grammar error: {error.splitlines()[0]}"
        return ""


def satisfies(grammar: Grammar, text: str) -> bool:
    """Whether a finished output's text meets its grammar: a regex matches the whole
    text (Python's `re`, which reads the simple regexes served here as llguidance does);
    a JSON schema's text parses as JSON and its value meets the schema's keywords
    `type`, `enum`, `properties`, `required`, `additionalProperties` (false),
    `minimum`, `maximum`, `minLength`, `maxLength` (other keywords are not checked)."""
    import re

    if grammar.kind == "regex":
        return re.fullmatch(grammar.source, text, re.DOTALL) is not None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return _meets(json.loads(grammar.source), value)


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "null": lambda v: v is None,
}


def _meets(schema: dict[str, Any], value: Any) -> bool:
    """`value` meets the subset of JSON-schema keywords `satisfies` checks."""
    kind = schema.get("type")
    if kind is not None and not _JSON_TYPES[kind](value):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        return False
    size = len(value) if isinstance(value, str) else 0
    if isinstance(value, str) and not schema.get("minLength", 0) <= size <= schema.get(
        "maxLength", size
    ):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", ())):
            return False
        if schema.get("additionalProperties", True) is False and set(value) - set(props):
            return False
        return all(_meets(props[k], v) for k, v in value.items() if k in props)
    return True
