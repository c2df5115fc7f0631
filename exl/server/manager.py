"""The model manager: which model is loaded, loading and unloading it, and where models may come from.

Models load only from folders inside the configured model directory: a name is a relative path without
`..`, and the folder (and every file in it) must resolve, symlinks followed, to a place inside that
directory. One model (plus an optional draft model) is loaded at a time; loading runs in a worker
thread so the server keeps answering (generation requests get 503 meanwhile).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

from exl.server.config import ServerConfig, cache_bits
from exl.server.errors import APIError
from exl.server.tools import detect_format

log = logging.getLogger("exl.server")

DEFAULT_CACHE_LIMIT = 32768  # default cache size cap (tokens) for models with a longer context


@dataclass
class LoadedModel:
    """A model ready to generate: weights, tokenizer, paged cache, generator and its async driver."""

    name: str
    path: Path
    model: object
    tokenizer: object
    stack: "GeneratorStack"
    max_seq_len: int
    cache_size: int
    cache_mode: str
    tool_format: str
    chat_template: str | None = None  # override of the tokenizer's template
    draft_name: str | None = None
    loaded_at: float = field(default_factory=time.time)
    jobs: set = field(default_factory=set)  # AsyncJobs in flight, cancelled on unload

    @property
    def cache(self):
        return self.stack.cache

    @property
    def generator(self):
        return self.stack.generator

    @property
    def async_generator(self):
        return self.stack.async_generator

    @property
    def vocab_limit(self) -> int:
        """Token ids below this are valid for both the tokenizer and the model's embedding."""
        return min(self.tokenizer.vocab_size, self.model.config.vocab_size)

    def card(self) -> dict:
        return {"id": self.name, "created": int(self.loaded_at), "loaded": True, "max_seq_len": self.max_seq_len,
                "cache_size": self.cache_size, "cache_mode": self.cache_mode, "draft_model": self.draft_name,
                "tool_format": self.tool_format, "generator_restarts": self.stack.restarts}


class ModelManager:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.model_dir = Path(config.model.model_dir).expanduser()
        self.current: LoadedModel | None = None
        self.loading: str | None = None  # name being loaded
        self._lock = asyncio.Lock()

    # -- where models may come from -----------------------------------------------------------------------------

    def _root(self) -> Path:
        try:
            return self.model_dir.resolve(strict=True)
        except (FileNotFoundError, NotADirectoryError):
            raise APIError(404, f"the model directory {self.model_dir} does not exist; create it or set --model-dir",
                           code="model_dir_missing") from None

    def resolve(self, name: str) -> Path:
        """The folder of model `name` inside the model directory; 400/403/404 for anything else."""
        if not isinstance(name, str) or not name.strip() or "\x00" in name:
            raise APIError(400, "model name must be a non-empty folder name", param="name", code="invalid_model_name")
        parts_posix, parts_win = PurePosixPath(name), PureWindowsPath(name)
        if parts_posix.is_absolute() or parts_win.is_absolute() or parts_win.drive or name.startswith(("/", "\\")):
            raise APIError(400, f"model name {name!r} is an absolute path; give a folder name inside the model "
                           f"directory", param="name", code="invalid_model_name")
        if any(p in ("..", ".") for p in parts_win.parts) or any(p in ("..", ".") for p in parts_posix.parts):
            raise APIError(400, f"model name {name!r} may not contain '.' or '..' parts", param="name",
                           code="invalid_model_name")
        root = self._root()
        try:
            folder = (root / name).resolve(strict=True)
        except (FileNotFoundError, NotADirectoryError, OSError):
            raise APIError(404, f"no model folder {name!r} in the model directory; GET /v1/models lists them",
                           param="name", code="model_not_found") from None
        if folder == root or not folder.is_relative_to(root):
            raise APIError(403, f"model {name!r} resolves to a place outside the model directory (a symlink?); "
                           f"models load only from inside {self.model_dir}", param="name", code="path_not_allowed")
        if not folder.is_dir() or not (folder / "config.json").is_file():
            raise APIError(404, f"{name!r} is not a model folder (no config.json)", param="name",
                           code="model_not_found")
        for entry in folder.rglob("*"):
            if not entry.resolve().is_relative_to(root):
                raise APIError(403, f"{name}/{entry.relative_to(folder)} links to a place outside the model "
                               f"directory; models load only from inside {self.model_dir}", param="name",
                               code="path_not_allowed")
        return folder

    def available(self) -> list[str]:
        """Model folders (with config.json) inside the model directory, one or two levels deep (org/name)."""
        try:
            root = self.model_dir.resolve(strict=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for config in list(root.glob("*/config.json")) + list(root.glob("*/*/config.json")):
            try:
                if config.resolve().is_relative_to(root):
                    found.append(config.parent.relative_to(root).as_posix())
            except OSError:
                continue
        return sorted(found)

    # -- state ------------------------------------------------------------------------------------------------

    def require(self, requested: str | None) -> LoadedModel:
        """The loaded model, checking that a request's `model` field names it (404 otherwise, 503 while loading)."""
        current = self.current
        if current is None:
            if self.loading:
                raise APIError(503, f"model {self.loading!r} is loading; try again shortly", code="model_loading",
                               headers={"Retry-After": "5"})
            raise APIError(404, "no model is loaded; an admin can load one with POST /v1/model/load",
                           param="model", code="model_not_found")
        if requested and requested != current.name:
            raise APIError(404, f"model {requested!r} is not loaded; this server serves {current.name!r} "
                           f"(GET /v1/models)", param="model", code="model_not_found")
        current.stack.heal()
        return current

    def stats(self) -> dict:
        m = self.current
        if m is None:
            return {"loaded": 0}
        cache, gen = m.cache, m.generator
        total = getattr(cache, "num_pages", 0)
        used = getattr(cache, "pages_in_use", 0)
        return {"loaded": 1, "running": getattr(gen, "num_running", 0), "waiting": getattr(gen, "num_waiting", 0),
                "preempted": getattr(gen, "num_preempted", 0),
                "preemptions": getattr(gen, "stats", {}).get("preemptions", 0),
                "pages_in_use": used, "pages_total": total, "cache_usage": used / total if total else 0.0}

    # -- load / unload ----------------------------------------------------------------------------------------

    async def load(self, name: str, **options) -> LoadedModel:
        """Unload the current model (cancelling its requests) and load `name`. Options override the config."""
        folder = self.resolve(name)
        draft_opts = options.pop("draft", None) or {}
        draft_name = draft_opts.get("name", self.config.draft.name)
        draft_folder = self.resolve(draft_name) if draft_name else None
        self._sizes(_context_of(folder), options)  # bad sizes fail before the current model is unloaded
        if self._lock.locked():
            raise APIError(409, f"a model load is already in progress ({self.loading!r}); wait for it to finish",
                           code="load_in_progress")
        async with self._lock:
            await self._unload()
            self.loading = name
            try:
                loaded = await asyncio.to_thread(self._load_sync, name, folder, draft_name, draft_folder, options,
                                                 draft_opts)
            finally:
                self.loading = None
            self.current = loaded
            log.info("loaded %s: max_seq_len %d, cache %d tokens (%s), tool calls: %s%s", name, loaded.max_seq_len,
                     loaded.cache_size, loaded.cache_mode, loaded.tool_format,
                     f", draft {draft_name}" if draft_name else "")
            return loaded

    async def unload(self) -> str | None:
        async with self._lock:
            return await self._unload()

    async def _unload(self) -> str | None:
        m = self.current
        if m is None:
            return None
        self.current = None
        name = m.name
        for job in list(m.jobs):
            try:
                await job.cancel()
            except Exception:  # a job that already ended
                pass
        await asyncio.to_thread(m.async_generator.close)  # joins the worker thread
        del m
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass
        log.info("unloaded %s", name)
        return name

    def _sizes(self, model_ctx: int, options: dict) -> tuple[int, int]:
        cfg = self.config.model
        max_seq_len = options.get("max_seq_len")
        if max_seq_len and max_seq_len > model_ctx:
            raise APIError(400, f"max_seq_len {max_seq_len} is longer than the model's context ({model_ctx})",
                           param="max_seq_len")
        if not max_seq_len and cfg.max_seq_len:  # the server-wide setting is capped by each model's context
            max_seq_len = min(cfg.max_seq_len, model_ctx)
        cache_size = options.get("cache_size") or cfg.cache_size
        if cache_size is None:
            cache_size = max_seq_len or min(model_ctx, DEFAULT_CACHE_LIMIT)
        if max_seq_len is None:
            max_seq_len = min(model_ctx, cache_size)
        if max_seq_len > cache_size:
            raise APIError(400, f"max_seq_len {max_seq_len} does not fit in the cache ({cache_size} tokens); raise "
                           f"cache_size (--cache-size) or lower max_seq_len", param="cache_size")
        page = cfg.page_size
        return max_seq_len, -(-cache_size // page) * page

    def _load_sync(self, name, folder, draft_name, draft_folder, options, draft_opts) -> LoadedModel:
        import exl
        from exl.errors import ExlError
        from exl.loading import pick_device
        from exl.tokenizer import Tokenizer

        cfg, dcfg = self.config.model, self.config.draft
        device = pick_device(cfg.device)
        t0 = time.perf_counter()
        mode = options.get("cache_mode") or cfg.cache_mode
        try:
            tokenizer = Tokenizer.from_dir(folder)
            parallel = cfg.tp > 1 or bool(cfg.gpu_split)
            model = exl.load_model(folder, device=cfg.device if parallel else device, tp=cfg.tp,
                                   gpu_split=cfg.gpu_split, progress=False)
            max_seq_len, cache_size = self._sizes(model.config.max_position_embeddings, options)
            draft_model = exl.load_model(draft_folder, device=device, progress=False) if draft_folder else None
            stack = GeneratorStack(
                model, tokenizer, cache_size=cache_size, page_size=cfg.page_size, cache_mode=mode,
                max_batch_size=options.get("max_batch_size") or cfg.max_batch_size, max_chunk_size=cfg.max_chunk_size,
                draft_model=draft_model, draft_cache_mode=draft_opts.get("cache_mode") or dcfg.cache_mode,
                num_draft_tokens=draft_opts.get("num_draft_tokens") or dcfg.num_draft_tokens,
                ngram_draft=dcfg.ngram if draft_opts.get("ngram") is None else draft_opts["ngram"])
            stack.build()
            _warm_constraints(tokenizer)
        except APIError:
            raise
        except (ExlError, FileNotFoundError, ValueError) as e:
            raise APIError(400, f"cannot load model {name!r}: {e}", param="name", code="model_load_failed") from e
        template = None
        if cfg.chat_template:
            template = Path(cfg.chat_template).expanduser().read_text(encoding="utf-8")
        fmt = options.get("tool_format") or cfg.tool_format
        if fmt == "auto":
            own = tokenizer.chat_template
            source = template or (own.get("tool_use") or own.get("default") if isinstance(own, dict) else own)
            fmt = detect_format(source)
        log.info("loaded %s in %.1f s on %s", folder, time.perf_counter() - t0, device)
        return LoadedModel(
            name=name, path=folder, model=model, tokenizer=tokenizer, stack=stack, max_seq_len=max_seq_len,
            cache_size=stack.cache.max_tokens, cache_mode=mode, tool_format=fmt, chat_template=template,
            draft_name=draft_name)


class GeneratorStack:
    """The paged cache(s), Generator and AsyncGenerator of a loaded model; rebuilt if the worker thread dies."""

    def __init__(self, model, tokenizer, *, cache_size, page_size, cache_mode, max_batch_size, max_chunk_size,
                 draft_model=None, draft_cache_mode="fp16", num_draft_tokens=4, ngram_draft=False):
        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.cache_size, self.page_size, self.cache_mode = cache_size, page_size, cache_mode
        self.max_batch_size, self.max_chunk_size = max_batch_size, max_chunk_size
        self.draft_cache_mode, self.num_draft_tokens, self.ngram_draft = draft_cache_mode, num_draft_tokens, ngram_draft
        self.cache = self.draft_cache = self.generator = self.async_generator = None
        self.restarts = 0

    def build(self) -> None:
        from exl.cache.paged import PagedCache
        from exl.generator import AsyncGenerator, Generator

        self.cache = self.draft_cache = self.generator = self.async_generator = None
        gc.collect()
        k_bits, v_bits = cache_bits(self.cache_mode, self.model.device)
        self.cache = PagedCache(self.model, max_tokens=self.cache_size, page_size=self.page_size, k_bits=k_bits,
                                v_bits=v_bits)
        if self.draft_model is not None:
            dk, dv = cache_bits(self.draft_cache_mode, self.draft_model.device)
            self.draft_cache = PagedCache(self.draft_model, max_tokens=self.cache_size, page_size=self.page_size,
                                          k_bits=dk, v_bits=dv)
        self.generator = Generator(
            self.model, self.cache, self.tokenizer, max_batch_size=self.max_batch_size,
            max_chunk_size=self.max_chunk_size, draft_model=self.draft_model, draft_cache=self.draft_cache,
            num_draft_tokens=self.num_draft_tokens, ngram_draft=self.ngram_draft)
        self.async_generator = AsyncGenerator(self.generator)

    @property
    def failed(self) -> BaseException | None:
        return getattr(self.async_generator, "error", None)

    def heal(self) -> None:
        """If the worker thread died, log why and start a fresh cache + generator (running requests are lost)."""
        error = self.failed
        if error is None:
            return
        self.restarts += 1
        log.error("the generator thread failed (%s: %s); restarting it (restart #%d)", type(error).__name__, error,
                  self.restarts)
        self.build()


def _context_of(folder: Path) -> int:
    """A model folder's context length, read from config.json without loading anything."""
    from exl.config import ModelConfig
    from exl.errors import ExlError

    try:
        return ModelConfig.from_dir(folder).max_position_embeddings
    except (ExlError, OSError, ValueError, KeyError, TypeError) as e:
        raise APIError(400, f"cannot read {folder.name}/config.json: {e}", param="name",
                       code="model_load_failed") from None


def _warm_constraints(tokenizer) -> None:
    """Build the constraint library's view of the tokenizer now (about a second) rather than on the event loop
    during the first request with a JSON schema or tools."""
    try:
        from exl.generator.constraints import ll_tokenizer

        ll_tokenizer(tokenizer)
    except Exception as e:  # noqa: BLE001 - constrained requests will report it
        log.warning("constrained output will not work: %s", e)
