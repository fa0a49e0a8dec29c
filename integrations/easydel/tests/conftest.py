"""Session fixtures: easydel imported once, the tokenizer saved once. The engines are built
per module (tests/test_esurge_relay.py): one as shipped, one on the relay."""

from __future__ import annotations

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
