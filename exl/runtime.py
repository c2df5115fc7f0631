"""Loading models for the command line: CLI arguments (--device, --tp, --gpu-split) to exl.load_model."""

from __future__ import annotations

from exl.loading import load_model, pick_device

__all__ = ["load_for_cli", "pick_device"]


def load_for_cli(path: str, args=None, progress: bool = True):
    """A model from a folder, honouring --tp / --gpu-split / --parallel-mode / --device when the command has them."""
    tp = getattr(args, "tp", None) or 1
    split = getattr(args, "gpu_split", None)
    device = getattr(args, "device", None)
    if tp > 1 or split:
        mode = getattr(args, "parallel_mode", None) or "tensor"
        return load_model(path, device=device, tp=tp, gpu_split=split, progress=progress, mode=mode)
    return load_model(path, device=pick_device(device), progress=progress)
