"""The hash every rank takes of its final full parameters: ranks that hold different models hash differently."""

from __future__ import annotations

import hashlib

import torch


def checksum(params: dict[str, torch.Tensor]) -> str:
    """A hash of every parameter's name, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(params):
        tensor = params[name].detach().contiguous().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()[:16]
