"""exl: mixed-precision quantization and fast local inference for LLMs."""

__version__ = "0.1.0"


def load_model(path, dtype=None, device="cpu", progress=True):
    """Load a Hugging Face or exl-quantized model folder (see exl.models)."""
    from exl.models import load_model as _load

    return _load(path, dtype, device, progress)
