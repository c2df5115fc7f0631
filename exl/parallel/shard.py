"""Building one rank's part of a model: a Builder that slices tensors at load time, and the
modules that reconnect the parts (partial sums, gathers, the vocabulary-split head, MoE).

Tensor parallel (Megatron layout): q/k/v and gate/up are split by output channel (KV-head groups,
channel blocks), o_proj and down_proj by input channel; each block's partial outputs are summed
with one all-reduce. Expert parallel: whole experts live on ranks, every rank routes, one
all-reduce combines. Layer split: each rank builds only its layers.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from exl import format as fmt
from exl.config import ModelConfig
from exl.errors import ModelLoadError
from exl.loader import TensorLoader
from exl.models.base import ARCHITECTURES, Builder, CausalLM
from exl.modules.linear import QUANT_TENSORS, Linear, is_quantized, is_trellis
from exl.modules.mlp import SparseMoE
from exl.parallel.comm import Comm
from exl.parallel.plan import ParallelError, channel_unit, snap_cuts, split
from exl.parallel.slicing import group_boundaries, quant_k_range, quant_rows, signs

MODES = ("tensor", "expert", "layer")


@dataclass
class ShardPlan:
    """What rank `rank` of `world` holds. Shares (relative device sizes) set every split."""

    mode: str
    rank: int
    world: int
    shares: list[float]
    config: ModelConfig
    layers: range | None = None  # layer mode: this rank's layers
    split_head: bool = True  # tensor/expert: vocabulary-split head (else replicated)
    all_layers: list[range] = field(default_factory=list)  # layer mode: every rank's layers

    def __post_init__(self):
        if self.mode not in MODES:
            raise ParallelError(f"parallel mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.layers is None:
            self.layers = range(self.config.num_layers)

    @property
    def kv_ranges(self) -> list[tuple[int, int]]:
        return split(self.config.num_kv_heads, self.shares, 1, "KV heads")

    @property
    def group(self) -> int:
        return self.config.num_heads // self.config.num_kv_heads

    def channel_ranges(self, total: int) -> list[tuple[int, int]]:
        return split(total, self.shares, channel_unit(total, self.world), "MLP channels")

    @property
    def vocab_ranges(self) -> list[tuple[int, int]]:
        v = self.config.vocab_size
        return split(v, self.shares, channel_unit(v, self.world), "vocabulary entries")

    @property
    def local_experts(self) -> range:
        e0, e1 = split(self.config.num_experts, self.shares, 1, "experts")[self.rank]
        return range(e0, e1)

    def view_config(self) -> ModelConfig:
        """The config of this rank's part, as a cache sees it: its KV heads, or its layers."""
        c = self.config
        if self.mode == "layer":
            return dataclasses.replace(c, num_layers=len(self.layers),
                                       layer_types=c.layer_types[self.layers.start : self.layers.stop])
        h0, h1 = self.kv_ranges[self.rank]
        return dataclasses.replace(c, num_kv_heads=h1 - h0, num_heads=(h1 - h0) * self.group)


# ---------------------------------------------------------------------------------------------
# Modules that reconnect the parts


class ShardLinear(nn.Module):
    """A rank's part of a split linear layer, plus what the part cannot do alone.

    In order: gather the full input from all ranks, rotate it (signs + blockwise Hadamard) and pick
    this part's input channels, multiply, rotate the output (and drop rows computed only to complete
    a Hadamard block), add the bias, sum over ranks. Rotations
    and bias are linear, so applying them before the sum is exact (the bias lives on one rank).
    """

    def __init__(self, inner: nn.Module, comm: Comm, *, gather_sizes=None, in_signs=None, in_block=None,
                 index=None, out_signs=None, out_block=None, out_keep=None, bias=None, reduce=False):
        super().__init__()
        self.inner, self.comm, self.gather_sizes, self.reduce = inner, comm, gather_sizes, reduce
        self.in_block, self.out_block, self.out_keep = in_block, out_block, out_keep
        self.register_buffer("in_signs", in_signs, persistent=False)
        self.register_buffer("index", index, persistent=False)
        self.register_buffer("out_signs", out_signs, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_sizes is not None:
            x = self.comm.all_gather_last(x, self.gather_sizes)
        if self.in_signs is not None:
            x = fmt.fwht(x * self.in_signs.to(x.dtype), self.in_block)
        if self.index is not None:
            x = x[..., self.index]
        z = self.inner(x)
        if self.out_signs is not None:
            z = fmt.fwht(z, self.out_block) * self.out_signs.to(z.dtype)
        if self.out_keep is not None:
            z = z[..., self.out_keep[0] : self.out_keep[1]]
        if self.bias is not None:
            z = z + self.bias
        return self.comm.all_reduce(z) if self.reduce else z


class NoInput(nn.Module):
    """The part of a row-split layer on a rank that got none of its input channels: zeros."""

    def __init__(self, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.dtype = out_features, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)


class VocabHead(nn.Module):
    """The output head split by vocabulary: each rank scores its slice, rank 0 gathers the logits."""

    def __init__(self, inner: nn.Module, comm: Comm, sizes: list[int]):
        super().__init__()
        self.inner, self.comm, self.sizes = inner, comm, sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.inner(x)
        full = self.comm.gather_last(local, self.sizes)
        return local if full is None else full


class RemoteExpert(nn.Module):
    """Stands in for an expert that lives on another rank."""

    def forward(self, x):
        raise RuntimeError("this expert lives on another rank")


class ParallelMoE(SparseMoE):
    """Routed experts spread over ranks: every rank routes all tokens, runs the experts it holds
    (whole experts, or its channel slice of every expert), and one all-reduce sums the outputs."""

    cpu_step = None  # the all-reduce is no part of the one-call decode step: these blocks run one by one

    def __init__(self, moe: SparseMoE, comm: Comm):
        super().__init__(moe.router, list(moe.experts), moe.top_k, moe.normalize, moe.shared, moe.shared_gate)
        self.comm = comm
        self.local = {i for i, e in enumerate(self.experts) if not isinstance(e, RemoteExpert)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            if e in self.local:
                token, slot = torch.nonzero(ids == e, as_tuple=True)
                out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        if self.shared is not None:  # channel-split: a partial sum, completed by the same reduction
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return self.comm.all_reduce(out).view(shape)


# ---------------------------------------------------------------------------------------------
# Loading a rank's part


@dataclass(frozen=True)
class Col:
    """Output channels [n0, n1) of a layer."""

    n0: int
    n1: int


@dataclass(frozen=True)
class Row:
    """Input channels [k0, k1) of a layer whose input is split; `sizes`: every rank's input width."""

    k0: int
    k1: int
    sizes: tuple[int, ...]
    reduce: bool = True


def _quant_linear(tensors: dict, device) -> nn.Module:
    from exl.modules.quant_linear import QuantLinear

    return QuantLinear({k: v.to(device) for k, v in tensors.items()})


class ShardedBuilder(Builder):
    """A Builder whose layers are this rank's parts (see ShardPlan). Layers it is not told to split
    (norms, routers, the embedding) are loaded whole."""

    def __init__(self, config, loader, dtype, device, comm: Comm, plan: ShardPlan):
        super().__init__(config, loader, dtype, device)
        self.comm, self.plan = comm, plan
        self._specs: dict[str, Col | Row] = {}

    @property
    def tensor_split(self) -> bool:
        return self.plan.mode != "layer"

    def layer_ids(self) -> range:
        return self.plan.layers

    def embedding(self):
        return None if self.plan.mode == "layer" and self.plan.rank else super().embedding()

    def head(self, embed_tokens):
        p, c = self.plan, self.config
        if p.mode == "layer":
            return None if p.rank else super().head(embed_tokens)
        if not p.split_head:
            return super().head(embed_tokens)
        vr = p.vocab_ranges
        v0, v1 = vr[p.rank]
        if "lm_head.weight" in self.loader or "lm_head.qweight" in self.loader:
            self._specs["lm_head"] = Col(v0, v1)
            inner = self.linear("lm_head", c.hidden_size, c.vocab_size)
        else:  # tied: this rank's rows of the embedding
            inner = Linear(embed_tokens[v0:v1].to(self.dtype))
        return VocabHead(inner, self.comm, [b - a for a, b in vr])

    def attention(self, prefix: str, layer: int, **kwargs):
        p, c = self.plan, self.config
        if self.tensor_split:
            kv = p.kv_ranges
            h0, h1 = kv[p.rank]
            q, hd = p.group * c.head_dim, c.head_dim
            self._specs.update({
                f"{prefix}.q_proj": Col(h0 * q, h1 * q),
                f"{prefix}.k_proj": Col(h0 * hd, h1 * hd),
                f"{prefix}.v_proj": Col(h0 * hd, h1 * hd),
                f"{prefix}.o_proj": Row(h0 * q, h1 * q, tuple((b - a) * q for a, b in kv)),
            })
        attn = super().attention(prefix, layer, **kwargs)
        if self.tensor_split:
            attn.num_kv_heads = h1 - h0
            attn.num_heads = (h1 - h0) * p.group
        attn.layer = layer - p.layers.start  # the cache of this rank's part counts its own layers
        return attn

    def mlp(self, prefix: str, intermediate: int | None = None, names=("gate_proj", "up_proj", "down_proj")):
        p = self.plan
        if not self.tensor_split:
            return super().mlp(prefix, intermediate, names)
        expert = re.search(r"\.experts\.(\d+)$", prefix)
        if expert and p.mode == "expert":
            return super().mlp(prefix, intermediate, names) if int(expert[1]) in p.local_experts else RemoteExpert()
        rngs = p.channel_ranges(intermediate or self.config.intermediate_size)
        c0, c1 = rngs[p.rank]
        in_moe = bool(expert) or prefix.endswith(".shared_expert")  # the MoE block reduces once for all
        g, u, d = names
        self._specs.update({f"{prefix}.{g}": Col(c0, c1), f"{prefix}.{u}": Col(c0, c1),
                            f"{prefix}.{d}": Row(c0, c1, tuple(b - a for a, b in rngs), reduce=not in_moe)})
        return super().mlp(prefix, intermediate, names)

    def linear(self, prefix: str, k: int, n: int, bias: bool = False):
        spec = self._specs.pop(prefix, None)
        if spec is None:
            return super().linear(prefix, k, n, bias)
        if is_trellis(self.loader, prefix):
            raise ModelLoadError(f"{self.loader.path}: layer {prefix!r} is trellis-coded; splitting trellis layers "
                                 f"across devices ({self.plan.mode} parallelism) is not supported yet. Use "
                                 "--parallel-mode layer (whole layers per device) or one device")
        if is_quantized(self.loader, prefix):
            t = self.loader.get_group(prefix, QUANT_TENSORS)
            if fmt.layer_shape(t) != (n, k):
                raise ModelLoadError(f"{self.loader.path}: quantized layer {prefix!r} is "
                                     f"{fmt.layer_shape(t)[0]}x{fmt.layer_shape(t)[1]}, expected {n}x{k} from config.json")
            if bias and "bias" not in t:
                raise ModelLoadError(f"{self.loader.path}: tensor {prefix + '.bias'!r} is missing")
            if "bias" in t:
                t["bias"] = t["bias"].to(self.dtype)
            return self._quant_col(prefix, t, spec) if isinstance(spec, Col) else self._quant_row(prefix, t, spec)
        w = self.loader.get(f"{prefix}.weight", self.dtype, (n, k))
        b = self.loader.get(f"{prefix}.bias", self.dtype, (n,)) if bias else None
        dev = self.device
        if isinstance(spec, Col):
            return Linear(w[spec.n0 : spec.n1].contiguous().to(dev),
                          None if b is None else b[spec.n0 : spec.n1].contiguous().to(dev))
        inner = Linear(w[:, spec.k0 : spec.k1].contiguous().to(dev))
        return ShardLinear(inner, self.comm, bias=b.to(dev) if b is not None and self.plan.rank == 0 else None,
                           reduce=spec.reduce)

    def _quant_col(self, prefix, t, spec: Col):
        n = t["qweight"].shape[0]
        if "sv" not in t:
            return _quant_linear(quant_rows(t, spec.n0, spec.n1), self.device)
        # The output rotation mixes channels within Hadamard blocks: compute the whole blocks that
        # overlap [n0, n1) (a few extra rows where the split cuts a block), rotate, keep [n0, n1).
        block, dev = fmt.hadamard_block(n), self.device
        a, b = spec.n0 // block * block, -(-spec.n1 // block) * block
        part = quant_rows(t, a, b)
        bias = part.pop("bias", None)
        keep = None if (a, b) == (spec.n0, spec.n1) else (spec.n0 - a, spec.n1 - a)
        return ShardLinear(_quant_linear(part, dev), self.comm, out_signs=signs(t["sv"], n, a, b).to(dev),
                           out_block=block, out_keep=keep,
                           bias=None if bias is None else bias[spec.n0 - a : spec.n1 - a].to(dev))

    def _quant_row(self, prefix, t, spec: Row):
        n, k = fmt.layer_shape(t)
        kb, dev = fmt.hadamard_block(k), self.device
        bounds = group_boundaries(t["qmeta"])
        local = ("perm" not in t and spec.k0 in bounds and spec.k1 in bounds
                 and ("su" not in t or (spec.k0 % kb == 0 and spec.k1 % kb == 0)))
        if local:  # this rank's input channels are its own slice of the stored layer
            j0, j1, gather, index = spec.k0, spec.k1, None, None
            in_signs = signs(t.get("su"), k, j0, j1)
        else:  # act-order (or misaligned groups): gather the whole input, take a group-aligned range
            j0, j1 = snap_cuts(k, self.plan.shares, bounds)[self.plan.rank]
            gather, in_signs = list(spec.sizes), signs(t.get("su"), k)
            index = t["perm"].long()[j0:j1] if "perm" in t else torch.arange(j0, j1)
        bias = t.get("bias") if self.plan.rank == 0 else None
        inner = _quant_linear(quant_k_range(t, j0, j1), dev) if j1 > j0 else NoInput(n, self.dtype)
        return ShardLinear(
            inner, self.comm, gather_sizes=gather,
            in_signs=None if in_signs is None else in_signs.to(dev), in_block=kb,
            index=None if index is None else index.to(dev),
            out_signs=None if "sv" not in t else signs(t["sv"], n).to(dev), out_block=fmt.hadamard_block(n),
            bias=None if bias is None else bias.to(dev), reduce=spec.reduce)


def build_shard(path: str | Path, plan: ShardPlan, comm: Comm, dtype: torch.dtype, device,
                progress: bool = False) -> CausalLM:
    """This rank's part of the model in `path`, sliced at load time from the one converted folder."""
    import exl.models  # noqa: F401  (registers the families)

    config = plan.config
    family = ARCHITECTURES.get(config.architecture)
    if family is None:
        raise ModelLoadError(f"{Path(path) / 'config.json'}: architecture {config.architecture!r} is not supported. "
                             f"Supported: {', '.join(sorted(ARCHITECTURES))}.")
    if plan.mode == "expert" and config.num_experts == 0:
        raise ParallelError(f"{path}: expert parallelism needs a mixture-of-experts model; "
                            f"{config.architecture} has no experts (use tensor parallelism)")
    loader = TensorLoader(path)
    builder = ShardedBuilder(config, loader, dtype, device, comm, plan)
    model = family(config, loader, dtype, device, progress, builder=builder)
    if plan.mode != "layer":
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, SparseMoE) and not isinstance(child, ParallelMoE):
                    setattr(module, name, ParallelMoE(child, comm))
    model.path = Path(path)
    return model.eval()
