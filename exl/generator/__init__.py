"""The dynamic generator: continuous batching over a paged KV cache with prefix reuse, samplers,
stop / banned strings, constraints and speculative decoding. See docs/generator.md."""

from exl.cache.paged import CacheCapacityError, PagedCache
from exl.generator.async_api import AsyncGenerator, AsyncJob
from exl.generator.generator import Generator
from exl.generator.job import EOS_REASONS, Event, Job
from exl.generator.sampling import SamplerSettings

__all__ = ["AsyncGenerator", "AsyncJob", "CacheCapacityError", "EOS_REASONS", "Event", "Generator", "Job",
           "PagedCache", "SamplerSettings"]
