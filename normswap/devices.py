"""Which device and dtype a command runs on: ``--device auto`` and ``--dtype auto`` resolved once,
the same way for every command, recipe step and fine-tune."""

from __future__ import annotations

from normswap.errors import NormswapError


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; a CUDA device asked for and absent
    is a user error, not a silent fallback."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NormswapError(f"--device {device} requested but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str):
    """auto -> bfloat16 on CUDA, float32 on CPU; otherwise the torch dtype of that name."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def available_memory(device: str = "cpu") -> int:
    """Bytes free to allocate now: the GPU's free memory on a CUDA device, else the machine's
    available memory (psutil: what can be had without swapping)."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    import psutil

    return int(psutil.virtual_memory().available)
