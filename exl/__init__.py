"""exl: mixed-precision quantization and fast local inference for LLMs."""

__version__ = "0.1.0"


def load_model(path, **kwargs):
    """Load a Hugging Face or exl-quantized model folder; see exl.loading.load_model for the options
    (device, dtype, tp, gpu_split, progress)."""
    from exl.loading import load_model as _load

    return _load(path, **kwargs)
