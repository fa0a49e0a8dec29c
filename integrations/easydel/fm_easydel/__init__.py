"""fm_easydel: EasyDeL 0.3.0's eSurge on fm_jax's relay, step N+1 dispatched before step N
is drained. Importing it refuses any easydel but 0.3.0 by name (`UnsupportedEasyDeL`).

    import fm_easydel
    engine = fm_easydel.build(model=model, tokenizer=tokenizer_dir, ...)  # eSurge's arguments
    engine.generate(prompts, sampling_params)
"""

from ._compat import EASYDEL_VERSION, UnsupportedEasyDeL, check_versions

check_versions()

from .engine import attach, build  # noqa: E402
from .relay import Relay, RelayError, Timeline  # noqa: E402

__all__ = [
    "EASYDEL_VERSION",
    "Relay",
    "RelayError",
    "Timeline",
    "UnsupportedEasyDeL",
    "attach",
    "build",
]
