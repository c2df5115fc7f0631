"""What a GPU would do with exl's CUDA kernels, on paper and from the compiler (docs/benchmarks.md).

    python bench/cuda_report.py            # markdown tables to stdout (compiles for six archs: minutes)

1. Per kernel, from `ptxas -v` on sm_75/80/86/89/90/120 (cuda_ext.compile_check): registers, spills,
   static shared memory, theoretical occupancy, and the bytes each output costs (from the kernel's
   access pattern, written down in KERNELS below).
2. Whether the decode GEMV can keep the memory system busy (Little's law: bytes in flight per SM
   against bandwidth x latency / SMs) and whether L1 can feed its activation reads.
3. A roofline of single-stream decode tokens/s for SmolLM2-135M and Llama-3-8B at 4.0 bpw (and
   Llama-2-7B, to set beside ExLlamaV2's published RTX 4090 figures) on an RTX 3090 and 4090.
Every assumption is a named constant here; nothing is measured on a GPU.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuda_ext.compile_check import LIMITS, kernel_usages  # noqa: E402

# ---------------------------------------------------------------------------------------------
# The kernels: launch shape (cuda_kernels.cu launchers) and access pattern per output element.
# b = bits, g = group size, M = activation rows, K = input channels, d = head dim.

KERNELS = {
    "gemv_kernel<MR>": dict(threads=128, dyn_smem=0, pattern=(
        "one warp per R = min(MR, 4) output rows: reads each row's K·b/8 code bytes and 2K/g scale bytes once "
        "(coalesced, lane l takes blocks l, l+32, ...); x (fp32 [M, K]) is staged per thread block in 1024-channel "
        "tiles in padded shared memory (4·M·K bytes read per block, each shared read used for R rows); writes "
        "4·M bytes per row", "DRAM: (K·b/8 + 2K/g)/M + 4 per output; L1: 4K/R per output")),
    "dequant_kernel": dict(threads=256, dyn_smem=0, pattern=(
        "one warp per row, a lane decodes one 32-code block per step and writes 64 B of fp16",
        "b/8 + 2/g read, 2 written")),
    "hadamard_kernel<TI, TO>": dict(threads=256, dyn_smem=0, pattern=(
        "one block per (row, 2048-value chunk): load, log2(block) butterfly passes in shared memory, store "
        "(at scatter[i] when the act-order permutation is fused in); optional sign bits and fp32 bias",
        "sizeof(TI) read + sizeof(TO) written (+1/8 signs, +4 bias, +4 scatter index)")),
    "trellis_gemv_kernel<MR>": dict(threads=128, dyn_smem=0, pattern=(
        "trellis code 1: one warp per 16 outputs and K-slice (>= 4 tiles, ~2048 warps a launch; split_sum_kernel "
        "adds the slices) loops over its tiles (b·32 B each, one coalesced load, "
        "words passed by shuffles); lane l decodes 8 weights of input 16j + l/2 (a multiply-add and a byte sum "
        "each) into MR·8 fp32 accumulators; x (fp32) read through L1", "b/8 + 2/16 read per weight and row group")),
    "two_table_gemv_kernel<MR, C>": dict(threads=128, dyn_smem=0, pattern=(
        "trellis codes 2 and 3: one warp per 16 outputs and K-slice (as code 1) loops over its tiles; lane l decodes "
        "8 weights (2 outputs x 4 inputs, two shared-memory table lookups each, 256 / 128 B of tables per block) and "
        "does MR float4 x loads and 8·MR FMAs", "b/8 + 2/16 read per weight and row group")),
    "split_sum_kernel": dict(threads=256, dyn_smem=0, pattern=(
        "one thread per (row, output): adds the trellis GEMV's S slice sums in order, scales", "4S read, 4 written")),
    "trellis_dequant_kernel": dict(threads=256, dyn_smem=0, pattern=(
        "one block per 16x16 tile: thread p decodes the weight at row p/16, column p%16 (either layout) and "
        "writes one fp16 (16 threads = one 32 B row segment)", "b/8 read, 2 written")),
    "kv_quantize_kernel<B>": dict(threads=128, dyn_smem=4 * 128 * 4, pattern=(
        "one warp per head vector (d = 128 shown: 2 KiB of dynamic shared memory per block), FWHT in shared "
        "memory, one lane per group of 32", "2 read, b/8 + 1/16 written per channel")),
    "kv_dequantize_kernel<B>": dict(threads=128, dyn_smem=4 * 128 * 4, pattern=(
        "one warp per head vector, decode per group, optional inverse FWHT", "b/8 + 1/16 read, 2 written")),
}


def family(kernel: str) -> str:
    base = kernel.split("<")[0]
    return next(k for k in KERNELS if k.split("<")[0] == base)


def kernel_tables(usages) -> str:
    archs = sorted({u.arch for u in usages}, key=int)
    out = ["| kernel | threads | " + " | ".join(f"sm_{a} regs / occ." for a in archs) + " | spills | smem |",
           "|---|---|" + "---|" * len(archs) + "---|---|"]
    by = {(u.kernel, u.arch): u for u in usages}
    for k in sorted({u.kernel for u in usages}):
        spec = KERNELS[family(k)]
        cells, spill, smem = [], 0, 0
        for a in archs:
            u = by[(k, a)]
            occ, _, lim = u.occupancy(spec["threads"], spec["dyn_smem"])
            cells.append(f"{u.registers} / {occ:.0%}" + ("" if occ == 1 else f" ({lim})"))
            spill += u.spill_stores + u.spill_loads
            smem = max(smem, u.smem)
        smem_txt = f"{smem} B" + (f" + {spec['dyn_smem']} B dyn." if spec["dyn_smem"] else "") if smem or spec[
            "dyn_smem"] else "0"
        out.append(f"| `{k}` | {spec['threads']} | " + " | ".join(cells) + f" | {spill} | {smem_txt} |")
    out += ["", "| kernel family | access pattern | bytes per output element |", "|---|---|---|"]
    for k, spec in KERNELS.items():
        out.append(f"| `{k}` | {spec['pattern'][0]} | {spec['pattern'][1]} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# GPUs and the paper model


@dataclass(frozen=True)
class GPU:
    name: str
    arch: str
    sms: int
    bandwidth: float  # bytes/s (the figure the issue gives)
    clock: float  # boost clock, Hz
    latency: float = 600e-9  # loaded DRAM latency assumed for Little's law
    l1_bytes_per_clock: int = 128  # L1 / shared-memory bandwidth per SM
    kernel_floor: float = 2.5e-6  # smallest time a dependent kernel takes (launch gap + ramp), queued ahead


GPUS = [GPU("RTX 3090", "86", 82, 936e9, 1.695e9), GPU("RTX 4090", "89", 128, 1008e9, 2.52e9)]


def rows_per_warp(mr: int) -> int:
    return min(mr, 4)  # gemv_rows_per_warp in cuda_kernels.cu


def gemv_efficiency(gpu: GPU, regs: int, n: int, k: int, bits: float, m: int = 1) -> tuple[float, float]:
    """(Little's-law fraction of bandwidth the GEMV can keep in flight, L1 fraction) for an N x K matrix."""
    from cuda_ext.compile_check import KernelUsage

    mr = 1 << (m - 1).bit_length()  # the instantiation the launcher picks: 1, 2, 4, 8
    r = rows_per_warp(mr)
    u = KernelUsage("gemv", gpu.arch, regs, 0, 0, 0, 0)
    _, resident, _ = u.occupancy(128)
    warps_per_sm = min(resident, n / r / gpu.sms)  # one warp per R output rows
    lanes_busy = min(32, k // 32)  # blocks of 32 codes per row, one per lane and step
    inflight = warps_per_sm * lanes_busy * 4 * bits * r  # each lane loads one block (4·b bytes) per row and step
    need = gpu.bandwidth * gpu.latency / gpu.sms
    dram_per_clock = gpu.bandwidth / (gpu.sms * gpu.clock)
    # fp32 x from shared memory: 128·M bytes per R blocks of 4·b weight bytes, read as conflict-free float4
    # (padded tile), so all of the 128 B/clock are useful; staging adds 128·M bytes per 4 warps' blocks
    smem_need = dram_per_clock * (128 * m / r + 128 * m / (4 * r)) / (4 * bits)
    return min(1.0, inflight / need), min(1.0, gpu.l1_bytes_per_clock / smem_need)


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int

    def linears(self) -> list[tuple[int, int]]:
        """(N, K) of one layer's quantized linears."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return [(self.heads * self.head_dim, h), (kv, h), (kv, h), (h, self.heads * self.head_dim),
                (self.inter, h), (self.inter, h), (h, self.inter)]


MODELS = [
    Model("SmolLM2-135M", 576, 1536, 30, 9, 3, 49152, 64),
    Model("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256, 128),
    Model("Llama-2-7B", 4096, 11008, 32, 32, 32, 32000, 128),
]
BPW, HEAD_BPW = 4.0, 6.25  # decoder linears at 4.0 bpw, the head at 6 bits (6.25 bpw with scales)
LAUNCHES_PER_LINEAR = 3  # hadamard (fp16 -> fp32, su, perm), gemv, hadamard (sv, bias, -> fp16)
CONTEXT = 128  # tokens of fp16 KV cache read per step
EXLLAMAV2_4090 = {("Llama-2-7B", 3.0): 245, ("Llama-2-7B", 4.0): 207}  # tokens/s, published


def roofline(model: Model, gpu: GPU, usages) -> dict:
    regs = next(u.registers for u in usages if u.kernel == "gemv_kernel<1>" and u.arch == gpu.arch)
    mats = model.linears() * model.layers + [(model.vocab, model.hidden)]
    weight_bytes = sum(n * k for n, k in mats[:-1]) * BPW / 8 + model.vocab * model.hidden * HEAD_BPW / 8
    kv_bytes = 2 * model.layers * model.kv_heads * model.head_dim * CONTEXT * 2
    total = weight_bytes + kv_bytes
    t_bw = total / gpu.bandwidth
    t_gemv, worst = 0.0, 1.0
    for i, (n, k) in enumerate(mats):
        bits = HEAD_BPW if i == len(mats) - 1 else BPW
        eff = min(gemv_efficiency(gpu, regs, n, k, bits))
        worst = min(worst, eff)
        t_gemv += max(gpu.kernel_floor, n * k * bits / 8 / (gpu.bandwidth * eff))
    t_small = len(mats) * (LAUNCHES_PER_LINEAR - 1) * gpu.kernel_floor
    return dict(mb=total / 1e6, bw=1 / t_bw, gemv_only=1 / (t_gemv + kv_bytes / gpu.bandwidth),
                paper=1 / (t_gemv + t_small + kv_bytes / gpu.bandwidth), worst=worst, launches=len(mats) *
                LAUNCHES_PER_LINEAR)


def roofline_table(usages) -> str:
    out = ["| model (4.0 bpw, head 6.25) | GPU | bytes/token | bandwidth bound | GEMV at paper efficiency | "
           "+ 2 small kernels per linear | linear launches | ExLlamaV2 (published) |",
           "|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        for gpu in GPUS:
            r = roofline(model, gpu, usages)
            pub = EXLLAMAV2_4090.get((model.name, 4.0)) if gpu.name == "RTX 4090" else None
            pub_txt = f"{pub} t/s ({pub / r['bw']:.0%} of bound)" if pub else "–"
            out.append(f"| {model.name} | {gpu.name} | {r['mb']:.0f} MB | {r['bw']:.0f} t/s | {r['gemv_only']:.0f} t/s "
                       f"(worst matrix {r['worst']:.0%}) | {r['paper']:.0f} t/s | {r['launches']} | {pub_txt} |")
    return "\n".join(out) + "\n"


def gemv_table(usages) -> str:
    out = ["| GPU | rows M | rows per warp | GEMV regs | occupancy | Little's law (N=4096, K=4096, 4-bit) "
           "| shared-memory feed of x (fp32) |", "|---|---|---|---|---|---|---|"]
    for gpu in GPUS:
        for m, mr in ((1, 1), (2, 2), (4, 4), (8, 8)):
            u = next(u for u in usages if u.kernel == f"gemv_kernel<{mr}>" and u.arch == gpu.arch)
            occ, _, _ = u.occupancy(128)
            eff, l1 = gemv_efficiency(gpu, u.registers, 4096, 4096, 4.0, m)
            out.append(f"| {gpu.name} | {m} | {rows_per_warp(mr)} | {u.registers} | {occ:.0%} | {eff:.0%} | {l1:.0%} |")
    return "\n".join(out) + "\n"


def main() -> int:
    usages = kernel_usages()
    print("### Kernels (ptxas -v)\n")
    print(kernel_tables(usages))
    print("### Can the GEMV keep the memory system busy?\n")
    print(gemv_table(usages))
    print("### Decode roofline (single stream)\n")
    print(roofline_table(usages))
    for lim_arch, lim in sorted(LIMITS.items(), key=lambda kv: int(kv[0])):
        print(f"- sm_{lim_arch} ({lim.name}): {lim.max_warps} warps, {lim.max_blocks} blocks, "
              f"{lim.smem_per_sm // 1024} KiB shared memory per SM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
