"""`TrellisLinear`: a linear layer in the exl trellis-coded format (docs/format.md §7), run by the kernels.

The module holds only the stored tensors (`trellis`, `tscale`, `tmeta`, `su`, `sv` and an optional
`bias`) as buffers, never a decoded copy. `forward` (shared with QuantLinear, see KernelLinear) runs:

- on the CPU, float32: the extension's TrellisLinearCPU: u = H (D_u x) with the scalar layers'
  rotation kernels, then a decode-and-dot GEMV that decodes each 16x16 tile once for up to 16 rows
  (fewer than `gemm_min_rows` rows), else tile decode into a cache-sized block + BLAS GEMM, then
  y = D_v (H z) + bias. Each row's result is bit for bit the same at any batch size below
  `gemm_min_rows` (the GEMV's per-row arithmetic does not depend on the other rows);
- `exl.format.reference_forward` when the user asked for the reference path (EXL_NO_EXT=1) or no
  extension can be built (warned once by cuda_ext).

There are no CUDA trellis kernels yet: a trellis layer on a GPU raises, unless EXL_NO_EXT=1.
"""

from __future__ import annotations

import torch

from exl import format as F
from exl.modules.quant_linear import KernelLinear

# CPU batch sizes from which tile decode + BLAS GEMM beats the decode-and-dot GEMV (docs/benchmarks.md)
GEMM_MIN_ROWS = 32


class TrellisLinear(KernelLinear):
    """y = W x + b with W stored trellis-coded.

    Args:
        tensors: the layer's tensors keyed by the format's names without prefix: `trellis`, `tscale`,
            `tmeta`, `su`, `sv`, and optionally `bias`.
        gemm_min_rows: CPU only. From this many input rows on, use tile decode + BLAS GEMM (rows
            below it take the batch-invariant GEMV).
    """

    REQUIRED = ("trellis", "tscale", "tmeta", "su", "sv")
    OPTIONAL = ("bias",)
    exact = True  # trellis kernels always multiply fp32 activations

    def __init__(self, tensors: dict[str, torch.Tensor], *, gemm_min_rows: int | None = None):
        super().__init__(tensors)
        self.meta = F.TrellisMeta.from_tensor(tensors["tmeta"])  # validates bits, state bits, code, version
        n, k = self.out_features, self.in_features
        words = tensors["trellis"]
        if words.dtype != torch.int32 or words.shape != (n // F.TILE, k // F.TILE, self.meta.words_per_tile):
            raise ValueError(f"TrellisLinear: trellis must be int32 [{n // F.TILE}, {k // F.TILE}, "
                             f"{self.meta.words_per_tile}] for {self.meta.bits}-bit tiles, got "
                             f"{words.dtype} {list(words.shape)}")
        self.gemm_min_rows = gemm_min_rows or GEMM_MIN_ROWS

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, trellis K={self.meta.bits} L={self.meta.state_bits}"

    def _make_kernel(self, ext, device):
        if device.type == "cuda":
            raise NotImplementedError("TrellisLinear: there are no CUDA kernels for trellis-coded layers yet; "
                                      "run the model on the CPU, or set EXL_NO_EXT=1 for the (slow) reference path")
        if not hasattr(ext, "TrellisLinearCPU"):
            raise RuntimeError("TrellisLinear: the installed exl CPU extension predates trellis layers; rebuild it "
                               "(`EXL_BUILD_EXT=1 pip install .`, or remove the prebuilt cuda_ext/_exl_cpu*.so)")
        t = self.tensors()
        return ext.TrellisLinearCPU(t["trellis"], t["tscale"], t["tmeta"], t["su"], t["sv"], t.get("bias"))
