"""A paged KV cache shared by many sequences, with prefix reuse.

The cache is a fixed pool of `num_pages` pages of `page_size` token slots (per layer: [kv_heads,
num_pages * page_size, head_dim], see kv_store). Each sequence owns a `PageTable`: the list of its
pages in order. Pages are allocated as a sequence grows and released when it closes.

Prefix reuse: a full page is named by a chained hash of every token id up to its end (the hash of
page i covers pages 0..i). When a sequence opens with a prompt, every leading page whose hash is known
is taken as is, whether another sequence holds it right now or it was kept after its sequence closed
(released pages with known content stay in an LRU list and are recycled last). Past the last shared
page, the known page (full, or the partial last page of a closed sequence) that follows the same
prefix and agrees longest with the prompt is copied into the new sequence's first own page, so a
prompt that repeats an earlier one reuses all of it, not just whole pages.

Pages are reserved, then allocated one at a time as a sequence grows: `open` reserves room for
`max_tokens`, and `reserve` raises a sequence's reservation later, as far as the free and cached pages
allow beside every other open sequence's reservation (it says False when they do not: the Generator
then preempts a newer sequence). A reserved page is always there to allocate, and nothing an open
sequence holds is ever evicted.

    cache = PagedCache(model, max_tokens=8192, page_size=256)
    table = cache.open(prompt_ids, max_tokens=len(prompt_ids) + 200)   # None: wait, the cache is full
    cache.extend(table, n)                 # make room for n more tokens
    ctx = PagedContext(cache, [(table, n)])
    model(ids, ctx=ctx)                    # writes K/V of the n tokens, attends over the pages in place
    cache.commit(table, ids)               # they are now part of the sequence
    cache.close(table)
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from functools import cached_property

import numpy as np
import torch

from exl.cache.base import AttentionContext
from exl.cache.kv_store import FloatStore, make_store, rotation_matrix
from exl.errors import ExlError
from exl.modules import fused
from exl.modules.attention import scaled_attention


class CacheCapacityError(ExlError):
    """A sequence can never fit in the cache (it needs more pages than the cache has)."""


def chain_hashes(token_ids, page_size: int, prev: bytes = b"") -> list[bytes]:
    """Hash of every full page of token_ids; each hash covers all tokens up to the end of its page."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out = []
    for i in range(len(ids) // page_size):
        prev = hashlib.blake2b(prev + ids[i * page_size : (i + 1) * page_size].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


class PageTable:
    """One sequence's view of a PagedCache: its pages in order and how many tokens are stored."""

    def __init__(self, cache: "PagedCache", pages: list[int], token_ids: list[int], hashes: list[bytes], reserved: int):
        self.cache = cache
        self.pages = pages
        self.token_ids = token_ids  # ids whose keys/values are stored, len == length
        self.hashes = hashes  # chained hash of each full page so far
        self.reserved = reserved  # pages this sequence may still allocate
        self.reused = len(token_ids)  # tokens taken from the prefix cache at open
        self.closed = False

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def slot(self, pos: int) -> int:
        ps = self.cache.page_size
        return self.pages[pos // ps] * ps + pos % ps

    def runs(self, end: int) -> list[tuple[int, int, int]]:
        """Positions [0, end) as maximal runs of consecutive slots: (first position, first slot, count)."""
        ps, out = self.cache.page_size, []
        for i in range((end + ps - 1) // ps):
            n = min(ps, end - i * ps)
            slot = self.pages[i] * ps
            if out and out[-1][1] + out[-1][2] == slot and out[-1][2] % ps == 0:
                pos, first, count = out[-1]
                out[-1] = (pos, first, count + n)
            else:
                out.append((i * ps, slot, n))
        return out


CACHE_MODES = {"auto": (None, None), "fp32": (32, 32), "fp16": (16, 16), "q8": (8, 8), "q6": (6, 6), "q4": (4, 4),
               "q8k4v": (8, 4)}  # name -> (k_bits, v_bits); "auto": see cache_bits


def cache_bits(mode: str, device=None) -> tuple[int | None, int | None]:
    """(k_bits, v_bits) of a cache mode name (CACHE_MODES). "auto": fp16 for a model on the CPU (half the memory of
    float32; the C++ attention reads fp16 exactly converted, at half the bytes: ~1.4x faster attention over 16
    sequences, 1.5x at 1,024 positions), the model's dtype (None) elsewhere."""
    if mode not in CACHE_MODES:
        raise ValueError(f"cache mode {mode!r} is not one of {', '.join(CACHE_MODES)}")
    if mode == "auto" and device is not None and torch.device(device).type == "cpu":
        return 16, 16
    return CACHE_MODES[mode]


class PagedCache:
    """A pool of KV pages for one model, shared by all sequences of a Generator.

    num_pages / max_tokens: size of the pool (give one; max_tokens is rounded up to whole pages).
    page_size: tokens per page. k_bits / v_bits: storage of keys and values, independently: None for the
    model's dtype, 16 (fp16), 32 (fp32), or 8 / 6 / 4 bits (rotated, one fp16 scale per 32 values).
    """

    def __init__(self, model, num_pages: int | None = None, page_size: int = 256, k_bits: int | None = None,
                 v_bits: int | None = None, max_tokens: int | None = None, device=None):
        if page_size < 1:
            raise ValueError(f"PagedCache: page_size must be >= 1, got {page_size}")
        if num_pages is None:
            if max_tokens is None:
                raise ValueError("PagedCache: give num_pages=... or max_tokens=...")
            num_pages = -(-int(max_tokens) // page_size)
        elif max_tokens is not None:
            raise ValueError("PagedCache: give num_pages or max_tokens, not both")
        if num_pages < 1:
            raise ValueError(f"PagedCache: num_pages must be >= 1, got {num_pages}")
        c = model.config
        self.config, self.num_pages, self.page_size = c, int(num_pages), int(page_size)
        self.k_bits, self.v_bits = k_bits, v_bits
        self.device = torch.device(device) if device is not None else model.device
        self.dtype = model.dtype
        slots = self.num_pages * self.page_size
        self.rotation = rotation_matrix(c.head_dim).to(self.device)
        args = (c.num_layers, c.num_kv_heads, slots, c.head_dim, model.dtype, self.device, self.rotation)
        self.block = math.gcd(self.page_size, 32)  # tokens per block of a per-channel key store
        self.k = make_store(k_bits, *args, what="k_bits", block=self.block)
        self.v = make_store(v_bits, *args, what="v_bits", block=self.block)
        self._blocked = [st for st in (self.k, self.v) if hasattr(st, "open_blocks")]
        self.rotation_c = self.rotation.to(self.dtype)

        self._refs = [0] * self.num_pages
        self._free = set(range(self.num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()  # released pages with known content, oldest first
        self._page_hash: dict[int, bytes] = {}
        self._hash_page: dict[bytes, int] = {}
        self._page_tokens: dict[int, tuple[bytes, tuple]] = {}  # known page -> (hash of the pages before, its tokens)
        self._children: dict[bytes, dict[int, None]] = {}  # hash of a prefix -> known pages that follow it
        self._pending: dict[bytes, PageTable] = {}  # hashes of prompt pages being written by an open sequence
        self.reserved = 0  # sum of open sequences' reservations
        self._work: list[torch.Tensor] = []  # scratch buffers for batched attention (grown, never shrunk)

    # -- accounting -----------------------------------------------------------------------------------------------

    @property
    def pages_in_use(self) -> int:
        """Pages held by at least one open sequence."""
        return self.num_pages - len(self._free) - len(self._lru)

    @property
    def pages_cached(self) -> int:
        """Released pages kept for prefix reuse (recycled when nothing else is free)."""
        return len(self._lru)

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_available(self) -> int:
        """Pages a new reservation may take now: free or cached, and not reserved by an open sequence."""
        return len(self._free) + len(self._lru) - self.reserved

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        return self.k.bytes_per_slot + self.v.bytes_per_slot

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def check_fits(self, tokens: int, what: str = "sequence") -> None:
        """Raise CacheCapacityError if `tokens` tokens can never fit in this cache."""
        if self.pages_for(tokens) > self.num_pages:
            raise CacheCapacityError(
                f"{what} needs {tokens} tokens ({self.pages_for(tokens)} pages of {self.page_size}) but the cache "
                f"holds {self.max_tokens} ({self.num_pages} pages); shorten the prompt or max_new_tokens, "
                f"or build a larger PagedCache")

    def workspace(self, count: int, shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
        """`count` scratch tensors of `shape` (their contents are garbage), reused from one forward pass and layer
        to the next so that gathering keys does not allocate (and page-fault) fresh memory every time."""
        n = math.prod(shape)
        while len(self._work) < count:
            self._work.append(torch.empty(0, dtype=dtype, device=self.device))
        for i in range(count):
            if self._work[i].numel() < n or self._work[i].dtype != dtype:
                self._work[i] = torch.empty(max(n, self._work[i].numel()), dtype=dtype, device=self.device)
        return [w[:n].view(shape) for w in self._work[:count]]

    # -- sequences ------------------------------------------------------------------------------------------------

    def match(self, token_ids) -> tuple[list[int], list[bytes], bool]:
        """Cached pages for the longest reusable prefix of token_ids (at most len - 1 tokens, so at least one
        token is left to compute), their hashes, and whether the next page is being written by an open sequence."""
        hashes = chain_hashes(token_ids[: len(token_ids) - 1], self.page_size)
        pages = []
        for h in hashes:
            p = self._hash_page.get(h)
            if p is None:
                return pages, hashes[: len(pages)], h in self._pending
            pages.append(p)
        return pages, hashes, False

    def match_partial(self, token_ids, pages: int, prev: bytes) -> tuple[int | None, int]:
        """The known page following the first `pages` shared pages (prefix hash `prev`) that agrees longest with
        token_ids there (leaving at least one token to compute): (page, tokens in common) or (None, 0)."""
        start = pages * self.page_size
        want = token_ids[start : min(len(token_ids) - 1, start + self.page_size)]
        best, best_n = None, 0
        for p in self._children.get(prev, ()):
            have = self._page_tokens[p][1]
            n = 0
            for a, b in zip(have, want):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = p, n
        return best, best_n

    def pending_prefix(self, token_ids) -> bool:
        """True if an open sequence is computing a page this prompt could reuse once it is written."""
        return self.match(token_ids)[2]

    def open(self, token_ids, max_tokens: int, announce: bool = True) -> PageTable | None:
        """A new sequence that will hold up to `max_tokens` tokens and starts with prompt `token_ids`.

        Reuses cached prefix pages (the table starts with `length` > 0) and reserves what may be needed
        for the rest. Returns None if the reservation does not fit now (try again after others close).
        announce: register the prompt's full pages as pending so that later prompts can wait for them.
        """
        token_ids = [int(t) for t in token_ids]
        self.check_fits(max(max_tokens, len(token_ids)))
        pages, hashes, _ = self.match(token_ids)
        need = self.pages_for(max(max_tokens, len(token_ids))) - len(pages)
        revived = sum(1 for p in pages if self._refs[p] == 0)
        src, copied = self.match_partial(token_ids, len(pages), hashes[-1] if hashes else b"")
        revived += 1 if src is not None and self._refs[src] == 0 else 0  # held during the copy
        if need + revived > len(self._free) + len(self._lru) - self.reserved:
            return None
        for p in pages:
            self._ref(p)
        length = len(pages) * self.page_size
        table = PageTable(self, list(pages), token_ids[:length], list(hashes), need)
        self.reserved += need
        if src is not None:  # copy the common part of a known page into our first own page
            self._ref(src)
            self.extend(table, copied)
            dst = table.pages[-1]
            self.k.copy_slots(src * self.page_size, dst * self.page_size, copied)
            self.v.copy_slots(src * self.page_size, dst * self.page_size, copied)
            self._unref(src)
            table.token_ids.extend(token_ids[length : length + copied])
        table.reused = table.length
        if announce:
            for h in chain_hashes(token_ids, self.page_size)[len(pages) :]:
                self._pending.setdefault(h, table)
        return table

    def reserve(self, table: PageTable, tokens: int) -> bool:
        """Make sure the sequence can grow to `tokens` tokens: raise its reservation if the pages are there.
        False (nothing changes) if they are not, now: other sequences hold or have reserved them."""
        need = self.pages_for(tokens) - len(table.pages) - table.reserved
        if need <= 0:
            return True
        if need > len(self._free) + len(self._lru) - self.reserved:
            return False
        table.reserved += need
        self.reserved += need
        return True

    def extend(self, table: PageTable, n: int) -> None:
        """Allocate pages so that `n` more tokens fit after table.length."""
        need = self.pages_for(table.length + n) - len(table.pages)
        for _ in range(need):
            if table.reserved <= 0:
                raise RuntimeError(f"sequence grew past its reservation ({table.length + n} tokens)")
            table.pages.append(self._alloc(table.pages[-1] if table.pages else None))
            table.reserved -= 1
            self.reserved -= 1
        if self._blocked:
            blocks = self._blocks(table, table.length, table.length + n)
            for st in self._blocked:
                st.open_blocks(blocks)

    def _blocks(self, table: PageTable, lo: int, hi: int) -> list[int]:
        """Store blocks holding positions [lo, hi) of a sequence."""
        b = self.block
        return [table.slot(p) // b for p in range(lo // b * b, hi, b)]

    def commit(self, table: PageTable, token_ids, share: bool = True) -> None:
        """Tokens whose K/V were just written after table.length become part of the sequence.

        share: publish newly filled pages for prefix reuse now (prompt pages); otherwise at close.
        """
        old = table.length
        table.token_ids.extend(int(t) for t in token_ids)
        if self._blocked:  # blocks now wholly committed are final: round them
            b = self.block
            blocks = self._blocks(table, old // b * b, table.length // b * b)
            for st in self._blocked:
                st.close_blocks(blocks)
        if share:
            self._hash_full_pages(table)

    def truncate(self, table: PageTable, length: int) -> None:
        """Forget tokens from `length` on (rejected draft tokens, a rewind). Pages past the end are released
        back to the sequence's reservation; published pages are never cut into."""
        if length > table.length:
            raise ValueError(f"cannot truncate a sequence of {table.length} tokens to {length}")
        if length < len(table.hashes) * self.page_size:
            raise ValueError(f"cannot truncate into published page {length // self.page_size}")
        del table.token_ids[length:]
        if self._blocked and length % self.block:  # reopen the block we cut into
            for st in self._blocked:
                st.open_blocks(self._blocks(table, length, length + 1), restore=True)
        self.trim(table, length)

    def trim(self, table: PageTable, tokens: int | None = None) -> None:
        """Release pages beyond what `tokens` (default: table.length) tokens need."""
        keep = self.pages_for(table.length if tokens is None else tokens)
        while len(table.pages) > keep:
            self._discard_page_blocks(table.pages[-1])
            self._unref(table.pages.pop())
            table.reserved += 1
            self.reserved += 1

    def close(self, table: PageTable, share: bool = True) -> None:
        """Release the sequence. share: publish its full pages (generated ones too) and its partial last page
        for reuse first."""
        if table.closed:
            return
        if share:
            self._hash_full_pages(table)
            full, rest = divmod(table.length, self.page_size)
            last = table.pages[full] if rest and full < len(table.pages) else None
            if last is not None and self._refs[last] == 1 and last not in self._page_tokens:
                prev = table.hashes[full - 1] if full else b""
                self._know(last, prev, table.token_ids[full * self.page_size :])
                if self._blocked and table.length % self.block:  # round the partly filled block as it is
                    for st in self._blocked:
                        st.close_blocks(self._blocks(table, table.length, table.length + 1),
                                        valid=table.length % self.block)
        for p in table.pages:
            self._discard_page_blocks(p)
        for h in [h for h, t in self._pending.items() if t is table]:
            del self._pending[h]
        for p in table.pages:
            self._unref(p)
        self.reserved -= table.reserved
        table.pages, table.reserved, table.closed = [], 0, True

    def clear(self) -> None:
        """Forget every cached prefix (only when no sequence is open)."""
        if self.pages_in_use:
            raise RuntimeError("PagedCache.clear() while sequences are open")
        for p in list(self._lru):
            self._forget(p)
            self._free.add(p)
        self._lru.clear()

    # -- pages ----------------------------------------------------------------------------------------------------

    def _hash_full_pages(self, table: PageTable) -> None:
        full = table.length // self.page_size
        if full > len(table.hashes):
            prev = table.hashes[-1] if table.hashes else b""
            start = len(table.hashes) * self.page_size
            table.hashes += chain_hashes(table.token_ids[start : full * self.page_size], self.page_size, prev)
        for i in range(full):
            h, p = table.hashes[i], table.pages[i]
            if self._pending.get(h) is table:
                del self._pending[h]
            if h not in self._hash_page and p not in self._page_hash:
                self._hash_page[h], self._page_hash[p] = p, h
                self._know(p, table.hashes[i - 1] if i else b"", table.token_ids[i * self.page_size : (i + 1) * self.page_size])

    def _know(self, p: int, prev: bytes, tokens) -> None:
        """Record a page's content (it follows the prefix hashed `prev`) for partial reuse."""
        self._page_tokens[p] = (prev, tuple(tokens))
        self._children.setdefault(prev, {})[p] = None

    def _discard_page_blocks(self, p: int) -> None:
        """Drop staging rows of a page's unfinished blocks (when its sequence lets it go)."""
        if self._blocked:
            per = self.page_size // self.block
            for st in self._blocked:
                st.discard_blocks(range(p * per, (p + 1) * per))

    def _ref(self, p: int) -> None:
        if self._refs[p] == 0:
            self._lru.pop(p, None)
            self._free.discard(p)
        self._refs[p] += 1

    def _unref(self, p: int) -> None:
        self._refs[p] -= 1
        if self._refs[p] == 0:
            if p in self._page_tokens:
                self._lru[p] = None  # most recently used last
            else:
                self._free.add(p)

    def _forget(self, p: int) -> None:
        h = self._page_hash.pop(p, None)
        if h is not None:
            del self._hash_page[h]
        known = self._page_tokens.pop(p, None)
        if known is not None:
            siblings = self._children[known[0]]
            del siblings[p]
            if not siblings:
                del self._children[known[0]]

    def _alloc(self, after: int | None) -> int:
        """A free page: right after `after` if possible (keeps runs contiguous), else in the middle of the
        largest free gap (room for the new sequence to grow), else the least recently used cached page."""
        if after is not None and after + 1 in self._free:
            p = after + 1
        elif self._free:
            p = self._gap_page()
        elif self._lru:
            p, _ = self._lru.popitem(last=False)
            self._forget(p)
            self._refs[p] = 1
            return p
        else:
            raise RuntimeError("PagedCache: out of pages (reservation accounting is broken)")
        self._free.discard(p)
        self._refs[p] = 1
        return p

    def _gap_page(self) -> int:
        free = sorted(self._free)
        best_start, best_len, start = free[0], 0, free[0]
        for a, b in zip(free, free[1:] + [None]):
            if b != a + 1:
                n = a - start + 1
                if n > best_len:
                    best_start, best_len = start, n
                start = b
        if best_start == 0 or best_len < 4:
            return best_start
        return best_start + best_len // 2


# Segments of at most BATCHED_MAX_QUERIES new tokens (decode steps, drafts, short prompt tails) whose sequences
# hold at most BATCHED_MAX_KEYS tokens attend together, in one batched op over keys gathered into a padded
# [sequences, keys] table, when there are at least two of them. Past that length, copying keys costs more than the
# per-sequence ops it saves, and such sequences attend in place one by one.
BATCHED_MAX_QUERIES = 16
BATCHED_MAX_KEYS = 1024


class PagedContext(AttentionContext):
    """One forward pass over a packed batch: `input_ids` is [1, total], the new tokens of every sequence in
    order. segments: (table, n) pairs; sequence i contributes n tokens at positions table.length .. + n
    (pages for them must already exist: PagedCache.extend). Keys and values are written to their slots, then
    sequences attend over their own pages. Over a float32 store with the fused ops on, every row of the pass
    attends in one C++ call that reads the pages in place, in the one summation order of every attention path
    (cpu_fused.cpp): a row's output is the same bits whether it decodes alone, batched, in a prompt chunk or as a
    verified draft. Otherwise (quantized or float16 stores, the reference path): short segments of many sequences
    (decode steps, drafts) together in one batched op over their gathered keys (see BATCHED_MAX_KEYS); other
    segments (prompt chunks) one by one, in place (runs of consecutive slots are views, not copies)."""

    def __init__(self, cache: PagedCache, segments: list[tuple[PageTable, int]]):
        self.cache = cache
        self.tables = [t for t, _ in segments]
        self.counts = [n for _, n in segments]
        self.starts = [t.length for t in self.tables]
        ps = cache.page_size
        for table, n, start in zip(self.tables, self.counts, self.starts):
            if len(table.pages) * ps < start + n:
                raise RuntimeError("PagedContext: call PagedCache.extend before the forward pass")
        if all(n == 1 for n in self.counts):  # a decode step: one position per sequence
            pos = np.array(self.starts, dtype=np.int64)
        else:
            pos = np.concatenate([np.arange(s, s + n) for s, n in zip(self.starts, self.counts)])
        self._pos = pos
        super().__init__(_to_device(pos, cache.device)[None])
        self._masks: dict = {}

    # What the module-by-module path reads (the one-call decode step needs neither): built on first use.
    @cached_property
    def segments(self) -> list[tuple[int, int, int, list]]:
        """(offset in the packed batch, new tokens, first new position, runs of slots up to the last) per sequence."""
        offsets = np.cumsum([0] + self.counts[:-1]).tolist()
        return [(o, n, s, t.runs(s + n)) for o, n, s, t in zip(offsets, self.counts, self.starts, self.tables)]

    @cached_property
    def slots(self) -> torch.Tensor:
        """The slot of every new token, in packed-batch order."""
        ps = self.cache.page_size
        pages = np.concatenate([np.asarray(t.pages, dtype=np.int64)[np.arange(s, s + n) // ps]
                                for t, s, n in zip(self.tables, self.starts, self.counts)])
        return _to_device(pages * ps + self._pos % ps, self.cache.device)

    def decode_batch(self):
        """One new token of every sequence over a float32 or float16 store: the one-call decode step's paged view
        (AttentionContext.decode_batch)."""
        if "_decode_batch" not in self.__dict__:
            self._decode_batch = self._make_decode_batch()
        return self._decode_batch

    def _make_decode_batch(self):
        c = self.cache
        if not _cpu_float_stores(c):
            return None
        if any(n != 1 for n in self.counts):
            return None
        return c.k.data, c.v.data, self.rows[0], self.positions[0] + 1, c.page_size

    def _mask(self, i: int, window: int | None, runs):
        """Boolean [n, kept keys] for segment i; None when every query sees every kept key; "causal" for a
        plain causal square (a prompt from position 0)."""
        key = (i, window)
        if key not in self._masks:
            _, n, start, _ = self.segments[i]
            if start == 0 and len(runs) == 1 and (window is None or window >= n):
                self._masks[key] = "causal" if n > 1 else None
                return self._masks[key]
            q_pos = torch.arange(start, start + n)
            k_pos = torch.cat([torch.arange(p, p + c) for p, _, c in runs])
            diff = q_pos[:, None] - k_pos[None, :]
            mask = diff >= 0
            if window is not None:
                mask &= diff < window
            self._masks[key] = None if bool(mask.all()) else mask.to(self.cache.device)
        return self._masks[key]

    def _batch(self) -> "_Batched | None":
        """This forward pass's batched group (built on first use, from `segments` alone); None if too few qualify."""
        if "_batched" not in self.__dict__:
            self._batched = _Batched.build(self.segments, self.cache.device)
        return self._batched

    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The page tables [S, P] and each new token's sequence [T]."""
        tables = self.tables
        pages = np.zeros((len(tables), max(len(t.pages) for t in tables)), dtype=np.int64)
        for i, t in enumerate(tables):
            pages[i, : len(t.pages)] = t.pages
        seqs = np.repeat(np.arange(len(tables), dtype=np.int64), self.counts)
        return pages, seqs

    @cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the C++ paged attention reads: the page tables [S, P], each new token's sequence and position."""
        pages, seqs = self._tables()
        return torch.from_numpy(pages), torch.from_numpy(seqs), torch.from_numpy(self._pos)

    @cached_property
    def device_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rows` on the cache's device, for the CUDA paged attention (copied there once per forward pass)."""
        pages, seqs = self._tables()
        return _to_device(pages, self.cache.device), _to_device(seqs, self.cache.device), self.positions[0]

    def _in_place(self, q) -> bool:
        """Every row attends in one C++ call, reading a float32 or float16 store where it lies (cpu_fused.cpp's
        paged_attention: the decode step's kernel and summation order for prompt chunks and drafts too)."""
        return fused.ops(q) is not None and _cpu_float_stores(self.cache)

    def _cuda_in_place(self, q) -> bool:
        """Decode steps and drafts on a GPU attend in one launch over a float16/float32 store where it lies
        (cuda_attention.cu; GQA groups up to 8, heads up to 256); longer prompt chunks take SDPA over their runs.
        fused.disabled() (the reference path) turns it off."""
        return q.is_cuda and self._cuda_kernel_fits(q)

    def _cuda_kernel_fits(self, q) -> bool:
        c = self.cache
        if not fused.enabled() or max(self.counts) > BATCHED_MAX_QUERIES or type(c.k) is not FloatStore \
                or type(c.v) is not FloatStore:
            return False
        hq, d, hk = q.shape[2], q.shape[3], c.k.data.shape[1]
        return q.dtype in (torch.float16, torch.float32) and c.k.data.dtype is q.dtype and c.v.data.dtype is q.dtype \
            and hq % hk == 0 and hq // hk <= 8 and d <= 256

    def attend(self, layer, q, k, v, *, scale, window=None, softcap=None):
        c = self.cache
        c.k.write(layer, self.slots, k[0])
        c.v.write(layer, self.slots, v[0])
        if self._in_place(q):
            pages, seqs, pos = self.rows
            return fused.ops(q).paged_attention(q[0], c.k.data[layer], c.v.data[layer], pages, seqs, pos,
                                                c.page_size, scale, window or 0, softcap or 0.0)[None]
        if self._cuda_in_place(q):
            pages, seqs, pos = self.device_rows
            return _cuda_ext().paged_attention(q[0].contiguous(), c.k.data[layer], c.v.data[layer], pages, seqs, pos,
                                               c.page_size, scale, window or 0, softcap or 0.0)[None]
        if c.k.rotated:
            q = q @ c.rotation_c
        out = torch.empty_like(q)
        batched = self._batch()
        if batched is not None:
            batched.attend(c, layer, q[0], out[0], scale, window, softcap)
        for i, (offset, n, start, runs) in enumerate(self.segments):
            if batched is not None and i in batched.members:
                continue
            if window is not None:  # drop runs that no query of this segment can see
                lo = start - window + 1
                runs = [(p, s, cnt) for p, s, cnt in runs if p + cnt > lo]
                runs = [(max(p, lo), s + max(0, lo - p), cnt - max(0, lo - p)) for p, s, cnt in runs]
            keys = [c.k.read(layer, s, s + cnt) for _, s, cnt in runs]
            values = [c.v.read(layer, s, s + cnt) for _, s, cnt in runs]
            mask = self._mask(i, window, runs)
            o = _attend_runs(q[0, offset : offset + n].transpose(0, 1), keys, values, mask, scale, softcap)
            out[0, offset : offset + n] = o.transpose(0, 1)
        if c.v.rotated:
            out = out @ c.rotation_c.T
        return out


def _cpu_float_stores(c) -> bool:
    """Keys and values in float32 or float16 slots on the CPU (both alike): what the C++ paged attention reads."""
    return c.device.type == "cpu" and type(c.k) is FloatStore and type(c.v) is FloatStore \
        and c.k.data.dtype in (torch.float32, torch.float16) and c.k.data.dtype is c.v.data.dtype


class _Batched:
    """Short segments of one forward pass attending together: G sequences, each with up to `nq` queries (padded
    by repeating its last one) over its first L keys (padded with slot 0, masked out)."""

    def __init__(self, members: set[int], rows, valid, kslots, q_pos, device):
        self.members = members  # indices of the segments in the group
        self.g, self.nq = rows.shape
        self.L = kslots.shape[1]
        self.rows = torch.from_numpy(rows.reshape(-1)).to(device)  # packed-batch row of each (sequence, query)
        self.valid = None if valid.all() else torch.from_numpy(np.flatnonzero(valid.reshape(-1))).to(device)
        self.out_rows = self.rows if self.valid is None else self.rows[self.valid]
        self.kslots = torch.from_numpy(kslots.reshape(-1)).to(device)
        flat = rows.reshape(-1)  # rows r0, r0 + 1, ... (decode steps come first in a batch): slices, not gathers
        self.span = (int(flat[0]), int(flat[0]) + len(flat)) if self.nq == 1 and (np.diff(flat) == 1).all() else None
        self.q_pos, self.device = q_pos, device
        self._bias: dict = {}
        self._bufs = None

    @staticmethod
    def build(segments, device) -> "_Batched | None":
        members = [i for i, (_, n, start, _) in enumerate(segments)
                   if n <= BATCHED_MAX_QUERIES and start + n <= BATCHED_MAX_KEYS]
        if len(members) < 2:
            return None
        g, nq = len(members), max(segments[i][1] for i in members)
        L = max(segments[i][1] + segments[i][2] for i in members)
        rows, q_pos = np.empty((g, nq), dtype=np.int64), np.empty((g, nq), dtype=np.int64)
        valid = np.zeros((g, nq), dtype=bool)
        kslots = np.zeros((g, L), dtype=np.int64)
        last = np.arange(nq)
        for j, i in enumerate(members):
            offset, n, start, runs = segments[i]
            rows[j] = offset + np.minimum(last, n - 1)
            q_pos[j] = start + np.minimum(last, n - 1)
            valid[j, :n] = True
            for p, s, cnt in runs:
                kslots[j, p : p + cnt] = np.arange(s, s + cnt)
        return _Batched(set(members), rows, valid, kslots, q_pos, device)

    def bias(self, window: int | None) -> torch.Tensor | None:
        """Additive mask [G, 1, nq, L] (0 or -inf) for a window; None when every query sees all L keys."""
        if window not in self._bias:
            diff = self.q_pos[:, :, None] - np.arange(self.L)[None, None, :]
            ok = diff >= 0
            if window is not None:
                ok &= diff < window
            self._bias[window] = None if ok.all() else \
                torch.from_numpy(np.where(ok, 0.0, -np.inf).astype(np.float32)[:, None]).to(self.device)
        return self._bias[window]

    def attend(self, c: PagedCache, layer: int, q: torch.Tensor, out: torch.Tensor, scale, window, softcap) -> None:
        """q, out: [total, Hq, D] of the packed batch; fills the group's rows of out."""
        g, nq, L = self.g, self.nq, self.L
        hq, d = q.shape[1], q.shape[2]
        hkv = c.config.num_kv_heads
        grp = hq // hkv
        if self._bufs is None or self._bufs[0].dtype != q.dtype:
            self._bufs = c.workspace(2, (hkv, g * L, d), q.dtype)
        keys = c.k.gather(layer, self.kslots, self._bufs[0]).view(hkv, g, L, d)
        values = c.v.gather(layer, self.kslots, self._bufs[1]).view(hkv, g, L, d)
        # queries of one kv head side by side: [Hkv, G, grp * nq, D] (no K/V expansion)
        qs = q[self.span[0] : self.span[1]] if self.span else q.index_select(0, self.rows)
        qg = qs.view(g, nq, hkv, grp, d).permute(2, 0, 3, 1, 4).reshape(hkv, g, grp * nq, d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        bias = self.bias(window)
        if bias is not None:
            scores.view(hkv, g, grp, nq, L).add_(bias.to(scores.dtype))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, values).view(hkv, g, grp, nq, d).permute(1, 3, 0, 2, 4).reshape(g * nq, hq, d)
        if self.span:
            out[self.span[0] : self.span[1]] = o
            return
        if self.valid is not None:
            o = o.index_select(0, self.valid)
        out.index_copy_(0, self.out_rows, o)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`; to a GPU from pinned memory, without waiting for the stream (torch's host
    allocator keeps the pinned source until the copy is done)."""
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _cuda_ext():
    import cuda_ext

    return cuda_ext.cuda()


def _attend_runs(q, keys, values, mask, scale, softcap):
    """q [Hq, n, D]; keys/values: lists of [Hkv, count, D] (one per run, in position order); mask [n, total]
    or None. Returns [Hq, n, D]. A few queries (decode, drafts): grouped batched matmuls, run by run, one
    softmax over all runs; a prompt chunk over one run: the fused SDPA kernel."""
    hq, n, d = q.shape
    if isinstance(mask, str):  # "causal", over a single run
        return scaled_attention(q[None], keys[0][None], values[0][None], scale=scale, causal=True, softcap=softcap)[0]
    if len(keys) == 1 and n > 8:
        m = None if mask is None else mask[None, None]
        return scaled_attention(q[None], keys[0][None], values[0][None], scale=scale, mask=m, softcap=softcap)[0]
    hkv = keys[0].shape[0]
    g = hq // hkv
    qg = q.reshape(hkv, g * n, d)  # queries of one kv head side by side: no K/V expansion
    parts = [torch.bmm(qg, k.transpose(1, 2)) for k in keys]
    scores = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).mul_(scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.view(hkv, g, n, -1).masked_fill(~mask, float("-inf")).view(hkv, g * n, -1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if len(values) == 1:
        return torch.bmm(probs, values[0]).view(hq, n, d)
    out, col = None, 0
    for v in values:
        part = torch.bmm(probs[..., col : col + v.shape[1]], v)
        out = part if out is None else out.add_(part)
        col += v.shape[1]
    return out.view(hq, n, d)
