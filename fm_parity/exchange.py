"""Moving recorded arrays between frameworks for a bitwise comparison.

On CPU both twins' snapshots are host numpy arrays already (a copy: the JAX map donates
its buffers, the torch map writes in place), so nothing is exchanged. On CUDA the
snapshots stay on the device and JAX arrays reach torch through DLPack, zero copy on
the same device; bytes are then compared on the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_host(x: Any) -> bool:
    """Whether `x` is a host numpy array."""
    return isinstance(x, np.ndarray)


def to_torch(x: Any) -> Any:
    """A torch tensor viewing `x` (numpy: from_numpy; jax or torch: DLPack, zero copy)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if x.dtype.name == "bfloat16":  # numpy bf16 (ml_dtypes) has no torch twin dtype
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)
    return torch.from_dlpack(x)


def to_numpy(x: Any) -> np.ndarray:
    """A host numpy copy of `x` (torch bf16 comes back as numpy bf16 via int16 bits)."""
    if isinstance(x, np.ndarray):
        return x
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        return t.numpy().copy()
    return np.array(x)


def dtype_name(x: Any) -> str:
    """A framework-neutral dtype name ('int32', 'float32', 'bfloat16')."""
    return str(x.dtype).removeprefix("torch.")


def bytes_equal(a: Any, b: Any) -> bool:
    """Same dtype name, same shape, same raw bytes (NaN == NaN, -0.0 != 0.0)."""
    if dtype_name(a) != dtype_name(b) or tuple(a.shape) != tuple(b.shape):
        return False
    if is_host(a) and is_host(b):
        return a.tobytes() == b.tobytes()
    import torch

    ta, tb = to_torch(a), to_torch(b)
    if ta.device != tb.device:
        tb = tb.to(ta.device)
    return bool(torch.equal(_bytes_view(ta), _bytes_view(tb)))


def _bytes_view(t: Any) -> Any:
    """`t`'s bytes as a flat uint8 tensor (a copy only where `t` is not contiguous). torch
    calls a tensor of at most one element contiguous whatever its stride, and DLPack hands
    such CUDA arrays from JAX over with stride 0, which a dtype view refuses (contiguous()
    and clone() keep that stride): they are given unit stride, the same memory."""
    import torch

    flat = t.contiguous().reshape(-1)
    if flat.numel() <= 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)
