"""`QuantLinear`: a linear layer in the exl quantized format (docs/format.md §1), run by the kernels.

The module holds only the stored tensors (`qweight`, `qscale`, `qmeta` and the optional `perm`,
`su`, `sv`, `bias`) as buffers, never a dequantized copy. `forward` dispatches to:

- the CUDA extension for float16 inputs on a GPU (fused GEMV up to 8 rows, cuBLAS above);
- the CPU extension for float32 inputs on the CPU: a fused GEMV with int8-quantized activations
  for fewer than `gemm_min_rows` rows (or exact fp32 when `exact=True`; either reads the packed
  weights once for up to 16 rows), and tile-wise dequant + BLAS GEMM for more;
- `exl.format.reference_forward` only when asked for (EXL_NO_EXT=1). An extension that cannot be
  built raises cuda_ext.ExtensionBuildError; a device without exl kernels raises ExlError.
"""

from __future__ import annotations

import os

import torch

from exl import format as F
from exl.errors import ExlError

REQUIRED = ("qweight", "qscale", "qmeta")
OPTIONAL = ("perm", "su", "sv", "bias")
# CPU batch sizes from which dequant + BLAS GEMM beats the fused GEMV (measured, docs/benchmarks.md). The int8
# default is the kernel's own (`int8_gemm_min_rows`: 128 on the AVX2 table, 64 on AVX-VNNI, never
# (2**63-1) on AVX-512 VNNI, 17 on the scalar table); this one stands in
# where there is no kernel yet (or an older extension without the attribute).
GEMM_MIN_ROWS_INT8 = 17
GEMM_MIN_ROWS_EXACT = 8
GEMM_NEVER = 2**63 - 1  # a gemm_min_rows no batch reaches (int64 for the kernels)


def _default_exact() -> bool:
    return os.environ.get("EXL_CPU_EXACT", "0") == "1"


class KernelLinear(torch.nn.Module):
    """What QuantLinear and TrellisLinear share: the stored tensors as buffers (never a dense copy),
    the extension's layer object built lazily for the buffers' device, and the forward dispatch.

    Subclasses set REQUIRED / OPTIONAL (tensor names without the layer prefix) and `_make_kernel`.
    """

    REQUIRED: tuple[str, ...] = ()
    OPTIONAL: tuple[str, ...] = ()

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        missing = [k for k in self.REQUIRED if k not in tensors]
        unknown = sorted(set(tensors) - set(self.REQUIRED) - set(self.OPTIONAL))
        if missing or unknown:
            raise ValueError(
                f"{type(self).__name__} needs tensors {list(self.REQUIRED)} plus optional {list(self.OPTIONAL)} "
                f"(names without the layer prefix); missing {missing}, unknown {unknown}"
            )
        for name in self.REQUIRED + self.OPTIONAL:
            if name in tensors:  # contiguous here, so the kernels share these buffers instead of copying
                self.register_buffer(name, tensors[name].contiguous())
            else:
                setattr(self, name, None)
        self.out_features, self.in_features = F.layer_shape(tensors)
        self.bits_per_weight = F.bits_per_weight(tensors)
        self._kernel = None  # the extension's layer object (False: none), built on first forward

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by format name (what `exl.format` functions take)."""
        return {k: getattr(self, k) for k in self.REQUIRED + self.OPTIONAL if getattr(self, k) is not None}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bpw={self.bits_per_weight:.3f}"

    def _apply(self, fn, *args, **kwargs):
        self._kernel = None  # buffers may move or change: rebuild the kernel object lazily
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._kernel = None
        return super()._load_from_state_dict(*args, **kwargs)

    def _make_kernel(self, ext, device: torch.device):
        """The extension's layer object for these buffers (ext: the CPU or CUDA extension module)."""
        raise NotImplementedError

    def _build_kernel(self):
        import cuda_ext

        if cuda_ext.reference_only():
            return None
        device = getattr(self, self.REQUIRED[0]).device
        if device.type not in ("cpu", "cuda"):
            raise ExlError(f"{type(self).__name__}: exl has no kernels for device '{device.type}' (CPU and CUDA "
                           f"only); set EXL_NO_EXT=1 to run the slow plain-PyTorch reference path there on purpose")
        return self._make_kernel(cuda_ext.cuda() if device.type == "cuda" else cuda_ext.cpu(), device)

    def kernel(self):
        """The extension's layer object for the buffers' device, or None (reference path, EXL_NO_EXT=1)."""
        if self._kernel is None:
            self._kernel = self._build_kernel() or False
        return self._kernel or None

    def cpu_step(self, ext):
        """This layer in the one-call decode step (exl.modules.fused.step), or None without a CPU kernel."""
        k = self.kernel() if getattr(self, self.REQUIRED[0]).device.type == "cpu" else None
        return None if k is None else ext.LinearStep.quant(k, self.gemm_min_rows, self.exact)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self._kernel  # hot path: one attribute read, then straight into C++
        if k is None:
            k = self.kernel() or False
        if k is False:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"{type(self).__name__}: input has last dimension {x.shape[-1]}, "
                                 f"expected {self.in_features}")
            return F.reference_forward(x, self.tensors())
        if x.is_cuda:
            return k.forward(x if x.dtype == torch.float16 else x.half()).to(x.dtype)
        if x.dtype != torch.float32:
            return k.forward(x.float(), "auto", self.gemm_min_rows, self.exact).to(x.dtype)
        return k.forward(x, "auto", self.gemm_min_rows, self.exact)


class QuantLinear(KernelLinear):
    """y = W x + b with W stored in the exl format.

    Args:
        tensors: the layer's tensors keyed by the format's names without prefix: `qweight`,
            `qscale`, `qmeta`, and optionally `perm`, `su`, `sv`, `bias`.
        exact: CPU only. False (default; env EXL_CPU_EXACT=1 flips it): small batches multiply
            int8-quantized activations (per 32 channels, like llama.cpp's Q8_0), adding a relative
            output error of about 0.5% RMS; True: fp32 activations throughout.
        gemm_min_rows: CPU only. From this many input rows on, use dequant + BLAS GEMM (rows below
            it take the batch-invariant GEMV). Default: the CPU kernel's `int8_gemm_min_rows` for
            int8 activations (128 on the AVX2 table, 64 on AVX-VNNI, never on AVX-512 VNNI, 17 on the
            scalar table; measured over a whole model,
            docs/benchmarks.md), 8 with `exact=True` (the fp32 GEMV's cost per row is about GEMM's
            from 8 rows on).
    """

    REQUIRED = REQUIRED
    OPTIONAL = OPTIONAL

    def __init__(self, tensors: dict[str, torch.Tensor], *, exact: bool | None = None, gemm_min_rows: int | None = None):
        super().__init__(tensors)
        self.exact = _default_exact() if exact is None else exact
        self._gemm_min_rows = gemm_min_rows  # None: the default below

    @property
    def gemm_min_rows(self) -> int:
        """CPU: from this many input rows on, dequant + BLAS GEMM (given, else 8 exact, else the kernel's
        `int8_gemm_min_rows`, or GEMM_MIN_ROWS_INT8 before the kernel is built)."""
        if self._gemm_min_rows:
            return self._gemm_min_rows
        if self.exact:
            return GEMM_MIN_ROWS_EXACT
        return getattr(self._kernel or None, "int8_gemm_min_rows", GEMM_MIN_ROWS_INT8)

    @gemm_min_rows.setter
    def gemm_min_rows(self, rows: int | None) -> None:
        self._gemm_min_rows = rows

    def _make_kernel(self, ext, device):
        t = self.tensors()
        args = [t["qweight"], t["qscale"], t["qmeta"], t.get("perm"), t.get("su"), t.get("sv"), t.get("bias")]
        return ext.QuantLinearCUDA(*args) if device.type == "cuda" else ext.QuantLinearCPU(*args)
