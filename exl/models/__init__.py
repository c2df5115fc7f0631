"""Model families. Importing this package registers every architecture."""

from exl.models import gemma3, llama, moe, qwen  # noqa: F401
from exl.models.base import ARCHITECTURES, CausalLM

__all__ = ["ARCHITECTURES", "CausalLM"]
