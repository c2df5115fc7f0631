"""Model families. Importing this package registers every architecture."""

from exl.models import gemma3, llama, moe, qwen  # noqa: F401
from exl.models.base import ARCHITECTURES, CausalLM, load_model

__all__ = ["ARCHITECTURES", "CausalLM", "load_model"]
