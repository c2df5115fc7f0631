"""Every environment variable exl reads (EXL_*), with its default and meaning: the source of docs/env.md
and of `exl info`'s list of the variables in force (a test keeps the three in step)."""

from __future__ import annotations

import os

# name -> (default, meaning)
EXL_VARS: dict[str, tuple[str, str]] = {
    "EXL_NO_EXT": ("unset", "`1`: run without the compiled kernels, on the slow plain-PyTorch reference path (on purpose; "
                            "otherwise a kernel build failure is an error)"),
    "EXL_NO_FUSED": ("unset", "`1`: float32 CPU models run the plain-PyTorch ops instead of the fused CPU ops, and "
                              "the paged cache attends with plain-PyTorch ops on a GPU too (the quantized linears "
                              "still use the extension)"),
    "EXL_CPU_ISA": ("best available", "instruction set of the quantized CPU linears and the fused CPU ops: `scalar`, "
                                      "`avx2`, `avxvnni` or `avx512vnni` (one this CPU supports; `exl info` lists them)"),
    "EXL_CPU_AMX": ("`1` where supported", "`0`: the AVX-512 trellis int8 GEMV never uses AMX tile multiplies "
                                           "(with them, batches of 9 or more rows, code 1 from 5, run faster; the results are the same bits)"),
    "EXL_CPU_EXACT": ("`0`", "`1`: quantized CPU linears multiply small batches in exact fp32 instead of with "
                             "int8-quantized activations"),
    "EXL_THREADS": ("unset", "CPU threads: `N` fixes the count, `all` uses every usable core; unset, a model load leaves "
                             "out cores other processes keep busy (a 0.2 s probe, unless OMP_NUM_THREADS or "
                             "torch.set_num_threads fixed it)"),
    "EXL_CACHE": ("`~/.cache/exl`", "where downloaded and converted assets (the demo model, benchmark artifacts) live"),
    "EXL_PARALLEL_TIMEOUT": ("`300`", "seconds a tensor-parallel rank waits for the others before giving up"),
    "EXL_BUILD_EXT": ("unset", "`1` at `pip install` time: build the kernels as prebuilt extensions "
                               "(`EXL_BUILD_EXT=1 pip install --no-build-isolation .`) instead of on first use"),
}

# Not exl's own, but they decide how the kernels are built and run; `exl info` shows them too.
BUILD_VARS = ("TORCH_EXTENSIONS_DIR", "CXX", "CC", "CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS",
              "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def in_force() -> dict[str, str]:
    """The EXL_* variables set in this process (known or not) and the build variables above."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("EXL_") or k in BUILD_VARS}


def unknown() -> list[str]:
    """EXL_* variables set here that exl does not read (a typo, or one from another version)."""
    return [k for k in sorted(os.environ) if k.startswith("EXL_") and k not in EXL_VARS]
