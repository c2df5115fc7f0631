"""Mirroring rank 0's attention contexts on the other ranks.

The generator on rank 0 makes caches from the parallel model's `config`, which describes rank 0's
part (its KV heads, or its layers), and passes their contexts to `forward`. Each other rank keeps
a mirror cache of the same geometry for *its* part, and rebuilds an equivalent context from a
small description rank 0 sends with the forward's inputs. Cache memory is thus split with the
heads (tensor/expert parallel) or the layers (layer split).

A new kind of context (the paged cache) plugs in with `register_context(cls, describe, rebuild)`:
`describe(ctx, key_of)` returns something picklable and small (no cache storage; `key_of(cache)`
names a cache object across ranks), and `rebuild(state, mirror)` returns the context on a
follower, where `mirror(key, make)` gives the follower's cache for `key`, creating it with
`make(view_config, dtype, device)` the first time.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from exl.cache.base import NoCache
from exl.cache.contiguous import KVCache, KVCacheContext

_HANDLERS: dict[type, tuple] = {}


def register_context(cls: type, describe, rebuild) -> None:
    """Teach the parallel model to mirror contexts of type `cls` (see the module docstring)."""
    _HANDLERS[cls] = (describe, rebuild)


class CacheKeys:
    """Rank 0: gives each cache object a key, and remembers caches that have been freed."""

    def __init__(self):
        self._ids = itertools.count()
        self._keys = weakref.WeakKeyDictionary()
        self.freed: list[int] = []

    def __call__(self, cache) -> int:
        if cache not in self._keys:
            key = next(self._ids)
            self._keys[cache] = key
            weakref.finalize(cache, self.freed.append, key)
        return self._keys[cache]

    def take_freed(self) -> list[int]:
        out, self.freed = self.freed, []
        return out


class Mirrors:
    """A follower's caches, by rank 0's key, built for this rank's part of the model."""

    def __init__(self, view_config, device):
        self.view_config, self.device = view_config, torch.device(device)
        self.caches: dict[int, object] = {}

    def __call__(self, key: int, make):
        if key not in self.caches:
            self.caches[key] = make(self.view_config, self.device)
        return self.caches[key]

    def free(self, keys) -> None:
        for k in keys:
            self.caches.pop(k, None)


def describe(ctx, key_of: CacheKeys):
    """A small picklable description of rank 0's context."""
    for cls in type(ctx).__mro__:
        if cls in _HANDLERS:
            return (cls.__module__, cls.__qualname__, _HANDLERS[cls][0](ctx, key_of))
    raise TypeError(f"a parallel model cannot mirror attention contexts of type {type(ctx).__name__}: "
                    "register it with exl.parallel.context.register_context")


def rebuild(desc, mirror: Mirrors):
    module, name, state = desc
    for cls, (_, rebuild_fn) in _HANDLERS.items():
        if cls.__module__ == module and cls.__qualname__ == name:
            return rebuild_fn(state, mirror)
    raise TypeError(f"no mirror for attention context {module}.{name} on this rank")


# -- the contexts of exl.cache ------------------------------------------------------------------


def _describe_nocache(ctx: NoCache, key_of):
    return ctx.positions.cpu()


def _rebuild_nocache(positions, mirror: Mirrors):
    ctx = NoCache(positions.shape[0], positions.shape[1], mirror.device)
    ctx.positions = positions.to(mirror.device)
    return ctx


def _describe_kv(ctx: KVCacheContext, key_of):
    c = ctx.cache
    return dict(key=key_of(c), batch=c.batch, max_len=c.max_len, dtype=c.k.dtype, start=ctx.start,
                length=ctx.end - ctx.start)


def _rebuild_kv(s, mirror: Mirrors):
    def make(config, device):
        return KVCache(config, batch=s["batch"], max_len=s["max_len"], dtype=s["dtype"], device=device)

    cache = mirror(s["key"], make)
    cache.length = s["start"]  # rank 0 may have reset or truncated its cache since
    return cache.context(s["length"])


register_context(NoCache, _describe_nocache, _rebuild_nocache)
register_context(KVCacheContext, _describe_kv, _rebuild_kv)


def _register_paged() -> None:
    """The generator's paged cache: followers keep a page pool of the same geometry for their part;
    page bookkeeping stays on rank 0, which sends each forward's slots and runs."""
    try:
        from exl.cache.paged import PagedCache, PagedContext
    except ImportError:  # pragma: no cover  (an exl without the dynamic generator)
        return
    from types import SimpleNamespace

    from exl.cache.base import AttentionContext

    def describe_paged(ctx: PagedContext, key_of):
        c = ctx.cache
        return dict(key=key_of(c), num_pages=c.num_pages, page_size=c.page_size, k_bits=c.k_bits, v_bits=c.v_bits,
                    dtype=c.dtype, positions=ctx.positions.cpu(), slots=ctx.slots.cpu(), segments=ctx.segments,
                    rows=ctx.rows)  # page tables and rows for the in-place float32 attention (PagedContext.rows)

    def rebuild_paged(s, mirror: Mirrors):
        def make(config, device):
            shell = SimpleNamespace(config=config, device=device, dtype=s["dtype"])
            return PagedCache(shell, num_pages=s["num_pages"], page_size=s["page_size"], k_bits=s["k_bits"],
                              v_bits=s["v_bits"], device=device)

        cache = mirror(s["key"], make)
        ctx = PagedContext.__new__(PagedContext)
        AttentionContext.__init__(ctx, s["positions"].to(cache.device))
        ctx.cache, ctx.slots, ctx.segments, ctx._masks = cache, s["slots"].to(cache.device), s["segments"], {}
        ctx.rows = s["rows"]  # (a cached_property: this sets its value)
        ctx._decode_batch = None  # no page tables here: a follower's blocks run one by one
        return ctx

    register_context(PagedContext, describe_paged, rebuild_paged)


_register_paged()
