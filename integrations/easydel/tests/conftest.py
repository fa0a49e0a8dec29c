"""One eSurge as shipped and one on fm_jax's relay, built once for the whole session (each
build compiles for about a minute on the 2-core CPU)."""

from __future__ import annotations

import contextlib

import pytest
from fm_easydel import harness


@pytest.fixture(scope="session")
def ed():
    from fm_easydel._compat import import_easydel

    return import_easydel()


@pytest.fixture(scope="session")
def spec(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    harness.save_tokenizer(directory)
    return harness.EngineSpec(tokenizer_dir=str(directory))


@pytest.fixture(scope="session")
def engines(spec):
    """(shipped, relay): the same model weights, two engines."""
    with contextlib.ExitStack() as stack:
        shipped = stack.enter_context(harness.engine(spec, relay=False))
        relay = stack.enter_context(harness.engine(spec, relay=True))
        yield shipped, relay
