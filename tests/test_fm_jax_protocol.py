"""The relay protocols (fm_jax/ops/protocol.py): each rule that differs between them answered
in one place."""

from __future__ import annotations

import pytest

import fm_jax as fj
from fm_jax.ops.protocol import parse_protocol as relay_protocol


def test_the_protocols_rules_are_answered_in_one_place() -> None:
    """Each rule that differs between the protocols is one property of its Protocol
    object, parsed once from the public string."""
    s, g = relay_protocol("sentinel"), relay_protocol("gather")
    assert s.invalidates and not g.invalidates
    assert g.gathers_decode_ids and g.takes_token_slots and g.serves_spec_mixed
    assert not (s.gathers_decode_ids or s.takes_token_slots or s.serves_spec_mixed)
    with pytest.raises(fj.FutureMapError, match="protocol must be one of"):
        relay_protocol("gathered")
