"""`TrellisLinear`: a linear layer in the exl trellis-coded format (docs/format.md §7), run by the kernels.

The module holds only the stored tensors (`trellis`, `tscale`, `tmeta`, `su`, `sv`, code 2's tables
`tcode` and an optional `bias`) as buffers, never a decoded copy. `forward` (shared with QuantLinear,
see KernelLinear) runs:

- on the CPU, float32: the extension's TrellisLinearCPU: u = H (D_u x) with the scalar layers'
  rotation kernels, then a decode-and-dot GEMV that decodes each 16x16 tile once for up to 16 rows
  (fewer than `gemm_min_rows` rows; int8 activations unless `exact`), else tile decode into a
  cache-sized block + BLAS GEMM, then y = D_v (H z) + bias (z + bias without `sv`). Each row's result is bit for bit the
  same at any batch size below `gemm_min_rows` (the GEMV's per-row arithmetic does not depend on
  the other rows);
- on a GPU, float16: the CUDA extension's TrellisLinearCUDA (decode-and-dot GEMV up to 8 rows,
  tile dequantization + cuBLAS above; tested under the host harness, not yet run on a GPU);
- `exl.format.reference_forward` only when asked for (EXL_NO_EXT=1). An extension that cannot be
  built raises cuda_ext.ExtensionBuildError; one without trellis kernels raises RuntimeError.
"""

from __future__ import annotations

import torch

from exl import format as F
from exl.modules.quant_linear import GEMM_NEVER, KernelLinear, _default_exact

# CPU batch sizes from which tile decode + BLAS GEMM beats the decode-and-dot GEMV (docs/benchmarks.md):
# the int8 GEMV costs more per extra row than the fp32 one (one vpdpbusd per row and column on port 0)
GEMM_MIN_ROWS_INT8 = 17
GEMM_MIN_ROWS_EXACT = 32
# the two-table codes' int8 GEMV decodes without multiplies; each extra row is two vpdpbusd per 64 weights, so on
# the AVX-512 table it beats the GEMM at every batch size (a whole model, on AMD Zen 4 and on a Xeon;
# docs/benchmarks.md), on the AVX2 table only up to 16 rows; code 1's up to 95 rows on AVX-512, 16 elsewhere (the
# CPU kernel's `int8_gemm_min_rows` says which; these constants stand in before the kernel exists)
GEMM_MIN_ROWS_INT8_TWO_TABLE = 64


class TrellisLinear(KernelLinear):
    """y = W x + b with W stored trellis-coded.

    Args:
        tensors: the layer's tensors keyed by the format's names without prefix: `trellis`, `tscale`,
            `tmeta`, `su`, `tcode` (int8 [256] for code 2, [128] for code 3: required there, refused for code 1), and
            optionally `sv` (the output rotation, absent from format version 3's one-sided layers) and `bias`.
        exact: CPU only. False (default; env EXL_CPU_EXACT=1 flips it): the GEMV multiplies int8
            activations (per 32 channels, as QuantLinear's int8 path; about 0.5% RMS relative output
            error; the same bits on every CPU table); True: fp32 activations throughout.
        gemm_min_rows: CPU only. From this many input rows on, use tile decode + BLAS GEMM (rows
            below it take the batch-invariant GEMV). Default: the CPU kernel's `int8_gemm_min_rows` (codes
            2 and 3: no GEMM on the AVX-512 table, where their int8 GEMV is faster at every batch size, 17
            on the AVX2 table, where it is compute-bound, else 64; code 1: 96 on AVX-512, else 17), 32 (exact).
    """

    REQUIRED = ("trellis", "tscale", "tmeta", "su")  # sv: optional from format version 3 (§7.4)
    OPTIONAL = ("sv", "tcode", "bias")

    def __init__(self, tensors: dict[str, torch.Tensor], *, exact: bool | None = None, gemm_min_rows: int | None = None):
        super().__init__(tensors)
        self.meta = F.TrellisMeta.from_tensor(tensors["tmeta"])  # validates bits, state bits, code, version
        n, k = self.out_features, self.in_features
        words = tensors["trellis"]
        if words.dtype != torch.int32 or words.shape != (n // F.TILE, k // F.TILE, self.meta.words_per_tile):
            raise ValueError(f"TrellisLinear: trellis must be int32 [{n // F.TILE}, {k // F.TILE}, "
                             f"{self.meta.words_per_tile}] for {self.meta.bits}-bit tiles, got "
                             f"{words.dtype} {list(words.shape)}")
        F.check_tables(self.meta, tensors.get("tcode"), "TrellisLinear")
        self.exact = _default_exact() if exact is None else exact
        self._gemm_min_rows = gemm_min_rows  # None: the default below

    @property
    def gemm_min_rows(self) -> int:
        """CPU: from this many input rows on, tile decode + BLAS GEMM (given, else 32 exact, else the CPU kernel's
        `int8_gemm_min_rows`: for code 1 96 on the AVX-512 table, else 17; for codes 2 and 3 GEMM_NEVER on the AVX-512
        table, 17 on the AVX2 one, else 64; before the kernel is built, 17 / 64)."""
        if self._gemm_min_rows:
            return self._gemm_min_rows
        if self.exact:
            return GEMM_MIN_ROWS_EXACT
        k = self._kernel or None
        if hasattr(k, "int8_gemm_min_rows"):
            return k.int8_gemm_min_rows
        if self.meta.code not in F.TWO_TABLE_CODES:
            return GEMM_MIN_ROWS_INT8
        return GEMM_NEVER if getattr(k, "int8_every_batch", False) else GEMM_MIN_ROWS_INT8_TWO_TABLE

    @gemm_min_rows.setter
    def gemm_min_rows(self, rows: int | None) -> None:
        self._gemm_min_rows = rows

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, trellis K={self.meta.bits} L={self.meta.state_bits} code={self.meta.code}"

    def _make_kernel(self, ext, device):
        cls = "TrellisLinearCUDA" if device.type == "cuda" else "TrellisLinearCPU"
        if not hasattr(ext, cls):
            raise RuntimeError(f"TrellisLinear: the installed exl extension has no {cls} (it predates trellis layers); "
                               "rebuild it (`EXL_BUILD_EXT=1 pip install .`, or remove the prebuilt cuda_ext/_exl_*.so)")
        t = self.tensors()
        tables = {"tcode": t["tcode"]} if "tcode" in t else {}  # codes 2 and 3 only
        return getattr(ext, cls)(t["trellis"], t["tscale"], t["tmeta"], t["su"], t.get("sv"), t.get("bias"), **tables)
