"""Input checks for the PyTorch FutureMap.

Structural checks (rank, shape, dtype, device) read only metadata and are always on.
Value checks (slot range, duplicate live slots, int values that fit the buffer dtype,
sentinel range, no negative token or length relayed, no negative input id in the gather
protocol) read tensor contents;
they run on CPU tensors (no device sync there) and, on other devices, only in debug mode,
where a host sync is acceptable.

These are the rules fm_jax applies to host arrays: both twins refuse the same inputs, each
naming the field (tests/test_bad_input_table.py holds them to it).
"""

from __future__ import annotations

import numbers

import torch

from fm_torch.batch import ForwardMode
from fm_torch.errors import FutureMapError

INT_DTYPES = (torch.int32, torch.int64)
"""A map's token and length buffers' dtypes: what int rows are computed and indexed in."""
INTEGERS = tuple(
    getattr(torch, n)
    for n in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")
    if hasattr(torch, n)
)
"""Every integer dtype this torch has (never bool): what per-row ints (slots, ids, tokens,
lengths, an int relay field's rows) may come in, cast where every value fits
(docs/CONTRACT.md, 'Checks beyond SGLang')."""
_WIDE_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32") if hasattr(torch, n))
"""Unsigned dtypes torch has few ops for (no min or max on CPU): int64 holds them exactly."""
_UINT64 = getattr(torch, "uint64", None)
HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PROTOCOLS = ("sentinel", "gather")


def check_device(device: object) -> torch.device:
    """A FutureMap's device: a torch.device or a string naming one this torch can reach (a
    CUDA device without an index is the current one)."""
    if not isinstance(device, str | torch.device):
        raise FutureMapError(f"device must be a torch.device or a string, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as bad:
        raise FutureMapError(f"device {device!r} is not one torch names: {bad}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise FutureMapError(f"device {device!r}: this torch reaches no CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise FutureMapError(
                f"device {device!r}: this torch reaches {torch.cuda.device_count()} CUDA devices"
            )
    return dev


def check_flag(name: str, value: object, none: bool = False) -> None:
    """A FutureMap's switch: a bool (or None where `none`, meaning 'from the environment')."""
    if not isinstance(value, bool) and not (none and value is None):
        raise FutureMapError(f"{name} must be a bool{' or None' if none else ''}, got {value!r}")


def check_names(name: str, value: object) -> frozenset[str]:
    """A collection of field names (a tuple, list or set of strings; not one string)."""
    if not isinstance(value, tuple | list | set | frozenset) or not all(
        isinstance(n, str) for n in value
    ):
        raise FutureMapError(f"{name} must be a tuple of field names, got {value!r}")
    return frozenset(value)


def check_protocol(protocol: object) -> str:
    """A FutureMap's relay protocol: exactly one of the strings in PROTOCOLS."""
    if not isinstance(protocol, str) or protocol not in PROTOCOLS:
        raise FutureMapError(f"protocol must be 'sentinel' or 'gather', got {protocol!r}")
    return protocol


def check_1d_int(
    name: str, t: object, device: torch.device, dtypes: tuple[torch.dtype, ...] = INTEGERS
) -> torch.Tensor:
    """Return `t` if it is a 1-D tensor of one of `dtypes` (default: any integer dtype,
    whose values `check_fits` then judges) on `device`, else raise FutureMapError."""
    if not isinstance(t, torch.Tensor):
        raise FutureMapError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise FutureMapError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        want = "int32 or int64" if dtypes == INT_DTYPES else "an integer dtype"
        raise FutureMapError(f"{name} must have {want}, got {t.dtype}")
    if t.device != device:
        raise FutureMapError(f"{name} is on {t.device}, the FutureMap is on {device}")
    return t


def check_mode(mode: object) -> ForwardMode:
    """A batch's forward mode as a ForwardMode: an int of a ForwardMode value, never a bool,
    float, string or tensor (int() would make DECODE of True, 1.7 and "1")."""
    if isinstance(mode, bool) or not isinstance(mode, numbers.Integral):
        raise FutureMapError(f"forward_mode must be a ForwardMode, got {mode!r}")
    try:
        return ForwardMode(int(mode))
    except ValueError:
        raise FutureMapError(f"forward_mode must be a ForwardMode, got {mode!r}") from None


def check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    """Raise unless `t` has exactly `rows` leading entries (one per batch row)."""
    if t.shape[0] != rows:
        raise FutureMapError(f"{name} has {t.shape[0]} rows, indices have {rows}")


def check_tensor(
    name: str,
    t: object,
    device: torch.device,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
) -> torch.Tensor:
    """Return `t` if it has exactly `shape`, one of `dtypes` and lives on `device`."""
    if not isinstance(t, torch.Tensor):
        raise FutureMapError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise FutureMapError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise FutureMapError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if t.device != device:
        raise FutureMapError(f"{name} is on {t.device}, the FutureMap is on {device}")
    return t


def check_slots(name: str, indices: torch.Tensor, pool_size: int) -> None:
    """Value check: slots in [0, pool_size) and no live slot (>= 1) twice."""
    if indices.numel() == 0:
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= pool_size:
        bad = indices[(indices < 0) | (indices >= pool_size)].tolist()
        raise FutureMapError(f"{name} holds slots {bad} outside [0, {pool_size})")
    live = indices[indices != 0]
    uniq, counts = torch.unique(live, return_counts=True)
    if bool((counts > 1).any()):
        raise FutureMapError(
            f"{name} holds live slots {uniq[counts > 1].tolist()} more than once in one batch"
        )


def field_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes a relay field held in `dtype` takes rows in: any integer dtype for an int
    field (cast to it; `check_fits` judges the values), else `dtype` alone (docs/CONTRACT.md,
    'Relay fields')."""
    return INTEGERS if dtype in INTEGERS else (dtype,)


def check_fits(name: str, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Value check: every value of int rows (any integer dtype) is representable in the
    int `dtype` (an int64 or uint32 value into an int32 buffer); none is read where the
    rows' dtype holds only such values."""
    info, held = torch.iinfo(dtype), torch.iinfo(values.dtype)
    if values.numel() == 0 or (info.min <= held.min and held.max <= info.max):
        return
    if values.dtype == _UINT64:
        bits = values.view(torch.int64)  # a value above int64's max reads negative
        fits = not bool(((bits < 0) | (bits > info.max)).any())
    else:
        if values.dtype in _WIDE_UNSIGNED:
            values = values.to(torch.int64)  # exact
        fits = info.min <= int(values.min()) and int(values.max()) <= info.max
    if not fits:
        raise FutureMapError(f"{name} holds values that do not fit the {dtype} buffer")


def as_ints(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Int rows in a dtype torch indexes and computes with: `t` itself when int32 or int64,
    else cast to `dtype` (after `check_fits`, where values are checked: the cast is exact)."""
    return t if t.dtype in INT_DTYPES else t.to(dtype)


def check_non_negative(name: str, values: torch.Tensor) -> None:
    """Value check: tokens and lengths a forward relays are >= 0 (a stashed -1 would read
    as the consume poison, a negative length as a sentinel). Unsigned rows pass unread."""
    if values.numel() and values.dtype.is_signed and int(values.min()) < 0:
        bad = torch.unique(values[values < 0])[:8].tolist()
        raise FutureMapError(f"{name} holds negative values {bad}: token ids and lengths are >= 0")


def check_sentinels(name: str, input_ids: torch.Tensor, pool_size: int) -> None:
    """Value check: a sentinel -s names a slot s in [0, pool_size)."""
    if input_ids.numel() == 0:
        return
    if int(input_ids.min()) <= -pool_size:
        bad = input_ids[input_ids <= -pool_size].tolist()
        raise FutureMapError(f"{name} holds sentinels {bad} naming slots outside [0, {pool_size})")


def check_no_sentinels(name: str, input_ids: torch.Tensor) -> None:
    """Value check (gather protocol): host input ids are real token ids, all >= 0."""
    if input_ids.numel() and int(input_ids.min()) < 0:
        bad = torch.unique(input_ids[input_ids < 0])[:8].tolist()
        raise FutureMapError(
            f"{name} holds negative ids {bad}: the gather protocol has no sentinels "
            "(token ids are >= 0)"
        )


def check_at_most(name: str, t: torch.Tensor, rows: int) -> None:
    """`t` has at most `rows` entries (metadata only)."""
    if t.shape[0] > rows:
        raise FutureMapError(f"{name} has {t.shape[0]} entries, more than the batch's {rows} rows")


def check_running_rows(indices: torch.Tensor, mix: torch.Tensor) -> None:
    """Spec MIXED: the batch's last live rows (padding rows, slot 0, come after them) are
    its running rows, in `mix_running_indices` order (SGLang's layout), so the lengths
    bound there are the rows' own. Reads values."""
    live = indices[indices > 0]
    tail = live[max(live.shape[0] - mix.shape[0], 0) :]
    if not torch.equal(tail.to(torch.int64), mix.to(torch.int64)):
        raise FutureMapError(
            f"mix_running_indices {mix.tolist()} are not the slots of the batch's last live "
            f"rows {tail.tolist()}: a spec MIXED batch lists its running rows last, in order"
        )
