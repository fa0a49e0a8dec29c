"""The suite has teeth: every deliberately broken FutureMap variant is caught (each breaks
one rule of docs/CONTRACT.md)."""

from __future__ import annotations

import pytest

from fm_parity.mutations import MUTATIONS
from fm_parity.suite import Job, check_mutation

# retire_reuse is the smallest scenario with every ingredient the sentinel mutations and
# the dropped gather stash break: decode relays, retirement with immediate slot reuse,
# prefill stashes into reused slots. The gather protocol's MIXED and spec mistakes need a
# MIXED and a spec scenario, a lost verified id a spec scenario relaying them
# (spec_verified), lengths left unbound in a spec MIXED batch spec_mixed (gather only);
# check_mutation stops at the first scenario that catches, and runs each mutation under
# its own protocol (skipping scenarios that do not run under it); a confidence read's
# generation not snapshotted needs the confidence relay (spec_confidence, whose reads go
# into the streams the oracle checks; small and first: most mutations stop there);
# partial stashes that zero the rows they should keep need one that stashes partially
# (spec_partial). Debug
# off: the oracle (and input checks) must catch each bug without help from consume
# tracking. fm_jax-only
# mutations (parity catching) run in test_parity_cli.
SCENARIOS = (
    "spec_confidence",
    "retire_reuse",
    "mixed_batches",
    "spec_decode",
    "spec_verified",
    "spec_mixed",
    "spec_partial",
    "spec_mixed_reuse",  # host tails one short: the host's view of the lengths retires late
)
SUITE = [Job(n, "int32", False) for n in SCENARIOS]
# Seen by parity alone: a spec resolve that leaves the lengths it read unconsumed changes
# no value, only the poison in fm_jax's buffers (debug mode); the same bug in both twins
# leaves the buffers alike (no scenario reads a length twice).
PARITY_ONLY = ("lengths_not_consumed",)


def test_there_are_mutations_of_both_protocols():
    """Seven variants judged under the sentinel protocol (a lost verified id among them)
    and four gather-protocol ones (a host-length skip that still syncs among them); fewer
    means a dropped check."""
    protocols = [cls.judged_under for cls in MUTATIONS.values()]
    assert len(MUTATIONS) >= 11
    assert protocols.count("sentinel") >= 7 and protocols.count("gather") >= 4
    assert "skip_verified_id_stash" in MUTATIONS
    assert MUTATIONS["host_copy_syncs"].judged_under == "gather"


# A one-row resolve aliasing the buffer row shows only where something writes the row
# between the resolve and the forward's read: debug's consume poison (tested below).
ALIASING = ("one_row_aliases",)


@pytest.mark.parametrize("name", [n for n in MUTATIONS if n not in ALIASING + PARITY_ONLY])
def test_mutation_in_both_twins_is_caught_without_parity(name):
    """With the same bug in fm_jax and fm_torch, parity is blind (the traces agree); the
    oracle, the debug checks or the input checks must still catch it."""
    m = check_mutation(name, SUITE, mutate=("jax", "torch"))
    assert m.caught_by is not None, f"{name} slipped through"
    assert "parity" not in m.caught_by  # twins alike: a parity catch would mean nondeterminism


@pytest.mark.parametrize("name", ["skip_stash", "stale_slot_after_reuse", "skip_stash_rows"])
def test_debug_checks_catch_relay_bugs_in_both_twins(name):
    """Consume tracking (WRWR, and the poison a resolve leaves in the slots it read) must
    flag a dropped stash in either framework and either protocol, with no reference loop to
    compare against."""
    m = check_mutation(name, [Job("retire_reuse", "int32", True)], mutate=("jax", "torch"))
    assert m.caught_by is not None and "debug" in m.caught_by.split("+")


@pytest.mark.parametrize("mutate", [("jax",), ("jax", "torch")])
def test_a_one_row_view_is_caught_in_debug_mode(mutate):
    """A one-row resolve that hands out a view of the buffer row reads the poison its own
    consume check wrote back: parity catches it in fm_jax alone, the oracle in both."""
    m = check_mutation("one_row_aliases", [Job("one_row", "int32", True)], mutate=mutate)
    assert m.caught_by is not None and "oracle" in m.caught_by.split("+")
    assert ("parity" in m.caught_by) == (mutate == ("jax",))


def test_unconsumed_lengths_are_caught_by_parity_in_debug_mode():
    """A spec resolve that does not consume the verified lengths it read: fm_jax's buffers
    keep them where fm_torch's hold the poison, run in debug mode (`debug_only`) whatever
    the job says."""
    m = check_mutation("lengths_not_consumed", [Job("spec_decode", "int32", False)])
    assert m.caught_by == "parity", m


def test_a_read_of_lengths_waiting_twice_is_caught_by_debug_in_both_twins():
    """resolve_seq_lens_cpu waiting twice for one publish: every value is right, so only
    the debug 'fresh publish' check (both twins) sees it."""
    m = check_mutation("reads_lengths_twice", [Job("spec_decode", "int32", True)], ("jax", "torch"))
    assert m.caught_by == "debug", m
