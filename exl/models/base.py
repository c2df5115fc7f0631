"""The decoder-only language model skeleton shared by every architecture family.

A family file (llama.py, qwen.py, gemma3.py, moe.py) says how one block is built from the
checkpoint; this file embeds tokens, runs the blocks, and applies the final norm and head.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from exl.cache.base import NoCache
from exl.config import ModelConfig
from exl.errors import UnsupportedModelError
from exl.loader import TensorLoader
from exl.modules import fused
from exl.modules.attention import Attention
from exl.modules.linear import Linear, load_linear
from exl.modules.mlp import GatedMLP
from exl.modules.norm import RMSNorm
from exl.modules.rope import RotaryEmbedding

ARCHITECTURES: dict[str, type["CausalLM"]] = {}


def register(*names: str):
    def wrap(cls):
        for name in names:
            ARCHITECTURES[name] = cls
        return cls

    return wrap


class Builder:
    """Reads one block's weights: knows the config, the loader, the dtype and the device."""

    def __init__(self, config: ModelConfig, loader: TensorLoader, dtype: torch.dtype, device):
        self.config, self.loader, self.dtype, self.device = config, loader, dtype, device
        self._ropes: dict = {}

    # Hooks a sharding builder (exl.parallel) overrides: which layers, the embedding, the head.
    def layer_ids(self) -> range:
        """The decoder layers this model holds (all of them; a pipeline stage holds a range)."""
        return range(self.config.num_layers)

    def embedding(self) -> torch.Tensor | None:
        """The token embedding as stored, or None where this model does not embed tokens."""
        c = self.config
        return self.loader.get("model.embed_tokens.weight", shape=(c.vocab_size, c.hidden_size), device=self.device)

    def head(self, embed_tokens: torch.Tensor | None = None) -> nn.Module | None:
        """The output head: stored `lm_head`, else tied to the embedding (read here if not given)."""
        c = self.config
        if "lm_head.weight" in self.loader or "lm_head.qweight" in self.loader:
            return self.linear("lm_head", c.hidden_size, c.vocab_size)
        if embed_tokens is None:
            embed_tokens = self.embedding()
        return Linear(embed_tokens if embed_tokens.dtype == self.dtype else embed_tokens.to(self.dtype))

    def linear(self, prefix: str, k: int, n: int, bias: bool = False):
        return load_linear(self.loader, prefix, k, n, bias=bias, dtype=self.dtype, device=self.device)

    def norm(self, name: str, dim: int | None = None, offset: float = 0.0) -> RMSNorm:
        dim = dim or self.config.hidden_size
        return RMSNorm(self.loader.get(name, torch.float32, (dim,), self.device), self.config.rms_norm_eps, offset)

    def rope(self, layer: int) -> RotaryEmbedding:
        cfg = self.config.rope_for(layer)
        key = id(cfg)
        if key not in self._ropes:  # layers of one kind share one table
            self._ropes[key] = RotaryEmbedding(cfg, self.config.head_dim, self.config.max_position_embeddings).to(self.device)
        return self._ropes[key]

    def attention(self, prefix: str, layer: int, *, qkv_bias=False, o_bias=False, qk_norm=False,
                  norm_offset=0.0, scale=None, softcap=None) -> Attention:
        c = self.config
        hd, d = c.head_dim, c.hidden_size
        return Attention(
            layer,
            self.linear(f"{prefix}.q_proj", d, c.num_heads * hd, qkv_bias),
            self.linear(f"{prefix}.k_proj", d, c.num_kv_heads * hd, qkv_bias),
            self.linear(f"{prefix}.v_proj", d, c.num_kv_heads * hd, qkv_bias),
            self.linear(f"{prefix}.o_proj", c.num_heads * hd, d, o_bias),
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=hd, rope=self.rope(layer),
            scale=scale if scale is not None else hd**-0.5,
            window=c.sliding_window if c.is_sliding(layer) else None, softcap=softcap,
            q_norm=self.norm(f"{prefix}.q_norm.weight", hd, norm_offset) if qk_norm else None,
            k_norm=self.norm(f"{prefix}.k_norm.weight", hd, norm_offset) if qk_norm else None,
        )

    def mlp(self, prefix: str, intermediate: int | None = None, names=("gate_proj", "up_proj", "down_proj")):
        c = self.config
        i = intermediate or c.intermediate_size
        g, u, dn = names
        return GatedMLP(self.linear(f"{prefix}.{g}", c.hidden_size, i), self.linear(f"{prefix}.{u}", c.hidden_size, i),
                        self.linear(f"{prefix}.{dn}", i, c.hidden_size), c.hidden_act)


class CausalLM(nn.Module):
    """Embedding -> blocks -> final norm -> head. Subclasses implement `build_block`."""

    norm_offset = 0.0  # Gemma stores (weight - 1)
    embed_scale: float | None = None

    def __init__(self, config: ModelConfig, loader: TensorLoader, dtype=torch.float32, device="cpu", progress=True,
                 builder: Builder | None = None, lazy: bool = False):
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        b = builder or Builder(config, loader, dtype, device)
        if lazy:  # a skeleton (see `lazy`): nothing read yet
            self.builder = b
            self.embed_tokens = self.norm = self.lm_head = None
            self.layers = nn.ModuleList()
            return
        self.embed_tokens = self.build_embedding(b)
        blocks = b.layer_ids()
        if progress:
            blocks = tqdm(blocks, desc="loading", unit="layer", leave=False)
        self.layers = nn.ModuleList(self.build_block(b, i, f"model.layers.{i}") for i in blocks)
        self.norm = self.build_norm(b)
        self.lm_head = b.head(self.embed_tokens)

    @classmethod
    def lazy(cls, path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> "CausalLM":
        """The model of a folder with no weight read yet: its pieces are built one at a time, on request, with
        `model.builder` (build_embedding, build_block, build_norm, builder.head). The quantizer walks a source
        model this way, keeping one block in memory."""
        config = ModelConfig.from_dir(path)
        return cls._family(config, path)(config, TensorLoader(path), dtype, device, lazy=True)

    def build_embedding(self, b: Builder) -> nn.Parameter | None:
        """The token embedding. A half-precision one is kept as stored (a quantized model's embedding is fp16):
        rows are converted on lookup. Full precision stays in the compute dtype."""
        embed = b.embedding()
        if embed is None:
            return None
        return nn.Parameter(embed if embed.dtype == torch.float16 else embed.to(self.dtype), requires_grad=False)

    def build_block(self, b: Builder, layer: int, prefix: str) -> nn.Module:
        raise NotImplementedError

    def build_norm(self, b: Builder) -> RMSNorm:
        return b.norm("model.norm.weight", offset=self.norm_offset)

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype | None = None, device="cpu", progress=True) -> "CausalLM":
        """Load a Hugging Face or exl-quantized model folder onto one device (exl.load_model is the public
        entry: it also splits a model over several devices)."""
        config = ModelConfig.from_dir(path)
        family = cls._family(config, path)
        dtype = dtype or (torch.float16 if torch.device(device).type == "cuda" else torch.float32)
        require_kernels(config, dtype, device)
        model = family(config, TensorLoader(path), dtype, device, progress)
        model.path = Path(path)
        return model.eval()

    @staticmethod
    def _family(config: ModelConfig, path: str | Path) -> type["CausalLM"]:
        """The family class of a model folder's architecture."""
        import exl.models  # noqa: F401  (registers the families)

        family = ARCHITECTURES.get(config.architecture)
        if family is None:
            raise UnsupportedModelError(
                f"{Path(path) / 'config.json'}: architecture {config.architecture!r} is not supported. "
                f"Supported: {', '.join(sorted(ARCHITECTURES))}.")
        return family

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """Block 0's input. table: this embedding instead of the model's own (a lazy model's, built apart)."""
        table = self.embed_tokens if table is None else table
        h = nn.functional.embedding(input_ids, table).to(self.dtype)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=table.dtype).to(self.dtype)
        return h

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx=None, cache=None, last_only: bool = False,
                return_hidden: bool = False) -> torch.Tensor:
        """Logits (float32) for input_ids [B, T].

        ctx: an attention context (exl.cache); or cache: a KVCache to extend; neither: no cache.
        last_only: compute logits for the last position only (decode, prefill of a prompt).
        """
        if ctx is None:
            b, t = input_ids.shape
            ctx = cache.context(t) if cache is not None else NoCache(b, t, input_ids.device)
        h = self.embed(input_ids)
        out = self.decode_step(h, ctx)
        if out is None:
            for layer in self.layers:
                h = layer(h, ctx)
        else:
            h = out
        ctx.finish()
        if return_hidden:
            return h
        return self.logits(h[:, -1:] if last_only else h)

    # -- decode in one call ----------------------------------------------------------------------------------------
    # A decode batch of the paged float32 cache (one new token for each of any number of sequences) runs every block
    # inside the CPU extension (cuda_ext/csrc/cpu_step.cpp): each block composes its modules' `cpu_step` objects into
    # one, and this model strings them together. The same kernels and fused ops as the modules' fused path, without
    # the Python between them. Anything else (prefill, drafts, other caches, hooks, autograd) runs block by block.

    _step = None  # the extension's DecodeStep, False where it does not apply; built on first use

    def decode_step(self, h: torch.Tensor, ctx) -> torch.Tensor | None:
        """The blocks' output for h [1, sequences, hidden] in one call, or None: run them one by one."""
        batch = ctx.decode_batch()
        if batch is None:
            return None
        ext = fused.ops(h)
        if ext is None:
            return None
        if self._step is None:
            self._step = self._build_step(ext)
        if not self._step or self._hooked():
            return None
        n = h.shape[1]
        tables = [ctx.rope(r, h.dtype) for r in self._step_ropes]
        cos, sin = [c.view(n, 1, -1) for c, _ in tables], [s.view(n, 1, -1) for _, s in tables]
        ctx.launching()
        return self._step.forward(h[0], *batch, cos, sin)[None]

    def _build_step(self, ext):
        if not hasattr(ext, "DecodeStep") or not len(self.layers):
            return False
        ropes, step = [], ext.DecodeStep()
        for block in self.layers:
            b = fused.step(block, ext, ropes)
            if b is None:
                return False
            step.add(b)
        self._step_ropes = ropes
        # The modules' hook dicts themselves (registering a hook adds to them; they are never replaced), so the check
        # before every step is one C-level pass over ~10 dicts per block instead of attribute lookups in Python.
        self._hook_dicts = [d for block in self.layers for m in block.modules()
                            for d in (m._forward_hooks, m._forward_pre_hooks)]
        return step

    def _hooked(self) -> bool:
        """Forward hooks anywhere in the blocks (or global ones) need the module-by-module path."""
        g = nn.modules.module
        return bool(g._global_forward_hooks or g._global_forward_pre_hooks) or any(self._hook_dicts)

    def _apply(self, fn, *args, **kwargs):  # moved or converted: the kernels are rebuilt, so is the step
        self._step = None
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._step = None
        return super()._load_from_state_dict(*args, **kwargs)

    def logits(self, h: torch.Tensor, norm: nn.Module | None = None, head: nn.Module | None = None) -> torch.Tensor:
        """Float32 logits of final hidden states, soft-capped where the family caps them. norm / head: these instead
        of the model's own (a lazy model's, or a quantized head the quantizer compares)."""
        norm = self.norm if norm is None else norm
        head = self.lm_head if head is None else head
        logits = head(norm(h)).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return logits


def require_kernels(config: ModelConfig, dtype: torch.dtype, device) -> None:
    """Build (or load the cached) extension this model will run on, now: a build failure stops the load
    with cuda_ext.ExtensionBuildError (what failed, the compiler's first error, how to fix it) instead of
    a slow fallback. With EXL_NO_EXT=1 nothing is built and the reference path runs."""
    import cuda_ext
    from exl.modules import fused

    kind = torch.device(device).type
    if kind == "cuda" and config.quantization:
        cuda_ext.cuda()
    elif kind == "cpu" and (config.quantization or (dtype == torch.float32 and fused.enabled())):
        cuda_ext.cpu()

