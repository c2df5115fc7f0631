"""CPU kernels (cuda_ext) and QuantLinear against the plain-PyTorch reference in exl.format.

Error bounds (u = 2^-24, the fp32 unit roundoff; c = |u'| @ |Q|^T, the sum of absolute products
for each output, mapped through |H_N| when the output is rotated):

- dequantization is exact: every weight s * (q - (2^b-1)/2) fits in fp32;
- fp32 paths (fused fp32 GEMV, dequant + BLAS GEMM): |y - y_exact| <= 4 u (sqrt(K) + 8) c. Rounding
  errors of a K-term fp32 dot product grow like u sqrt(K) times the partial sums (which are below
  c), plus a few roundings per Hadamard stage (log2(128) <= 8 of them); the observed error is
  far below this, while a wrong code or scale gives errors of the size of y itself;
- int8-activation GEMV: each activation moves by at most half its block's step d = amax/127, so
  |y - y_exact| <= sum_k |Q[n, k]| d_k / 2 (times 1.001 for the rounding of x/d), plus the fp32
  bound. This is a hard bound; the typical error is its square root scale (~0.5% RMS relative).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from cuda_ext import build
from exl import format as F
from exl.modules.quant_linear import QuantLinear

from cuda_reference import abs_rotate, exact_and_scale  # noqa: E402  (tests/: one fp64 reference for both)

pytestmark = pytest.mark.kernels  # CI runs these under a second torch too (.ci/run)
U = 2.0**-24


@pytest.fixture(scope="module")
def ext():
    return build.load_cpu()  # fails (not skips) when the extension cannot be built


def isas():
    return build.load_cpu().isa_names()


def random_layer(n, segs, *, perm=True, su=True, sv=True, bias=True, seed=0, pow2_scales=False):
    g = torch.Generator().manual_seed(seed)
    k = sum(s.k_len for s in segs)
    codes = torch.cat([torch.randint(0, 2**s.bits, (n, s.k_len), generator=g) for s in segs], 1).to(torch.uint8)
    n_groups = sum(s.n_groups for s in segs)
    if pow2_scales:
        scale = 2.0 ** -torch.randint(6, 9, (n, n_groups), generator=g).float()
    else:
        scale = torch.rand(n, n_groups, generator=g) * 0.1 + 0.01
    t = {"qweight": F.pack_codes(codes, segs), "qscale": scale.half(), "qmeta": F.segments_to_meta(segs)}
    if perm:
        t["perm"] = torch.randperm(k, generator=g).to(F.perm_dtype(k))
    if su:
        t["su"] = F.pack_signs(torch.where(torch.rand(k, generator=g) < 0.5, -1, 1))
    if sv:
        t["sv"] = F.pack_signs(torch.where(torch.rand(n, generator=g) < 0.5, -1, 1))
    if bias:
        t["bias"] = torch.randn(n, generator=g)
    return t


def kernel(ext, t, isa="auto"):
    return ext.QuantLinearCPU(
        t["qweight"], t["qscale"], t["qmeta"], t.get("perm"), t.get("su"), t.get("sv"), t.get("bias"), isa
    )


def fp32_bound(c, k):
    return 4 * U * (math.sqrt(k) + 8) * c + 1e-30


def int8_bound(u, q, t, c, k):
    """Hard bound of the activation-rounding error (module doc), in the output domain."""
    m = u.shape[0]
    d = u.view(m, k // 32, 32).abs().amax(-1) / 127  # block steps in permuted order
    step = d.repeat_interleave(32, dim=1)
    e = (0.5 * 1.001 * step) @ q.abs().T
    if "sv" in t:
        e = abs_rotate(e)
    return e + fp32_bound(c, k)


def check(ext, t, m, path, isa="auto", seed=1):
    x = torch.randn(m, sum(int(r[0]) for r in t["qmeta"]), generator=torch.Generator().manual_seed(seed))
    got = kernel(ext, t, isa).forward(x, path).double()
    want, c, u, q = exact_and_scale(x, t)
    k = x.shape[1]
    bound = int8_bound(u, q, t, c, k) if path == "int8" else fp32_bound(c, k)
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"{path}/{isa}: max err {err.max():.3g}, worst err/bound {(err / bound).max():.3g}"
    return err, want


# ---------------------------------------------------------------------------------------------
# exact pieces


@pytest.mark.parametrize("bits", range(1, 9))
def test_dequantize_is_exact(ext, bits):
    segs = [F.Segment(64, bits, 32), F.Segment(128, 1 + (bits + 2) % 8, 64), F.Segment(128, bits, 128)]
    t = random_layer(13, segs, seed=bits)
    want = F.dequantize_codes(F.unpack_codes(t["qweight"], segs), t["qscale"], segs, torch.float32)
    for isa in ext.isa_names():
        assert torch.equal(kernel(ext, t, isa).dequantize(), want), isa


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("bits", range(1, 9))
def test_exact_inputs_give_exact_outputs(ext, isa, bits):
    # integer activations with a block maximum of 127 are represented exactly by the int8 path too;
    # with power-of-two scales every product and (small) sum is exact in fp32.
    segs = [F.Segment(96, bits, 32), F.Segment(128, bits, 64)]
    t = random_layer(21, segs, su=False, sv=False, bias=False, seed=bits, pow2_scales=True)
    g = torch.Generator().manual_seed(bits)
    x = torch.randint(-126, 127, (17, 224), generator=g).float()
    x.view(17, 7, 32)[:, :, 5] = 127.0  # block maxima at 127 (position 5 of each block in permuted order)
    x = x[:, torch.argsort(t["perm"].long())]  # so that u' = x[perm] has them
    want = exact_and_scale(x, t)[0].float()
    k = kernel(ext, t, isa)
    for path in ("int8", "fp32", "gemm"):
        assert torch.equal(k.forward(x, path), want), path
        for m in range(3):  # one row: the decode kernels (4 weight rows per step, 4-bit pair unpack)
            assert torch.equal(k.forward(x[m : m + 1], path), want[m : m + 1]), (path, m)
    for path in ("int8", "fp32"):  # every small batch: weights unpacked once for all rows
        for m in range(2, 18):
            assert torch.equal(k.forward(x[17 - m :], path), want[17 - m :]), (path, m)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("n", [1, 8, 16, 24, 32, 64, 576, 1536, 7 * 128])
@pytest.mark.parametrize("signs_first", [True, False])
def test_fwht_matches_reference(ext, isa, n, signs_first):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=g)
    signs = F.pack_signs(torch.where(torch.rand(n, generator=g) < 0.5, -1, 1))
    s = F.unpack_signs(signs, n, torch.float64)
    want = F.fwht(x.double() * s) if signs_first else F.fwht(x.double()) * s
    got = ext.fwht(x, 0, signs, signs_first, isa)
    block = F.hadamard_block(n)
    tol = 4 * U * (math.log2(block) + 1) * math.sqrt(block) * x.abs().max()
    assert (got.double() - want).abs().max() <= tol
    assert torch.allclose(ext.fwht(x, 0, None, True, isa).double(), F.fwht(x.double()), atol=float(tol), rtol=0)
    # every table runs the same butterflies in the same order: the AVX2 table's bits (the AVX-512 one holds whole
    # blocks in registers)
    if isa != "scalar" and "avx2" in isas():
        assert torch.equal(got, ext.fwht(x, 0, signs, signs_first, "avx2"))


# ---------------------------------------------------------------------------------------------
# the forward sweep


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("group", [32, 64, 128])
def test_forward_every_bit_width(ext, isa, bits, group):
    t = random_layer(33, [F.Segment(384, bits, group)], seed=bits * group)
    for path, m in (("int8", 1), ("int8", 5), ("fp32", 1), ("fp32", 6), ("gemm", 3)):
        check(ext, t, m, path, isa)


MIXES = {
    "exl2-like": [F.Segment(64, 6, 32), F.Segment(512, 4, 64)],
    "all-widths": [F.Segment(32 * (b + 1), b, 32 * (b % 2 + 1)) for b in range(1, 9)],
    "wide-groups": [F.Segment(256, 3, 128), F.Segment(192, 5, 96), F.Segment(1152, 2, 128)],
}


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("n", [1, 7, 33, 577])
def test_forward_mixed_segments_odd_n(ext, isa, mix, n):
    t = random_layer(n, MIXES[mix], seed=n)
    for path, m in (("int8", 1), ("int8", 7), ("fp32", 2), ("gemm", 19)):
        check(ext, t, m, path, isa, seed=m)


SMALL_BATCH_MIXES = {
    "all-widths": MIXES["all-widths"],
    # more blocks than one unpack chunk (64 blocks), groups straddling the chunk boundary
    "long-segments": [F.Segment(2304, 3, 96), F.Segment(2176, 4, 128), F.Segment(96, 8, 32)],
}


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("mix", sorted(SMALL_BATCH_MIXES))
def test_forward_every_small_batch(ext, isa, mix):
    # the small-batch kernels tile the activation rows (up to 8 per tile, 16 per pass over the
    # weights): every batch size 1..17 against the reference, odd N, all bit widths
    t = random_layer(13, SMALL_BATCH_MIXES[mix], seed=5)
    for m in range(1, 18):
        for path in ("int8", "fp32"):
            check(ext, t, m, path, isa, seed=m)


# The 512-bit int8 GEMV works on 4 blocks at a time ("quads", a segment's last one partial), with
# per-group scales spread over the quad, several activation rows in tiles of 8 and of 4 quads,
# and the weights unpacked in chunks of 64 quads: segments ending 1, 2 or 3 blocks into a quad,
# groups of 1, 2, 3, 4 and 8 blocks, every bit width, and more than one chunk.
QUAD_MIXES = {
    "quad-tails": [
        F.Segment(32, 3, 32),
        F.Segment(64, 5, 64),
        F.Segment(96, 6, 96),
        F.Segment(224, 7, 32),
        F.Segment(256, 4, 256),
        F.Segment(160, 2, 32),
        F.Segment(32, 8, 32),
        F.Segment(96, 1, 32),
        F.Segment(128, 4, 64),
    ],
    "chunks": [F.Segment(8192, 4, 128), F.Segment(96, 3, 32), F.Segment(2112, 5, 64)],
}


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("mix", sorted(QUAD_MIXES))
def test_int8_quad_tails_and_chunks(ext, isa, mix):
    t = random_layer(11, QUAD_MIXES[mix], seed=len(mix))
    for m in (1, 2, 3, 4, 5, 8, 9, 12, 16, 17):
        check(ext, t, m, "int8", isa, seed=m)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("k", [32, 96, 544, 1536, 2080])
def test_int8_every_isa_shapes_and_batches(ext, isa, k):
    # batch sizes 1..64 (17+ rows run in passes of 16), 4-bit codes with act-order and rotations
    t = random_layer(37, [F.Segment(k, 4, 32)], seed=k)
    for m in (1, 2, 3, 4, 7, 9, 16, 17, 33, 64):
        check(ext, t, m, "int8", isa, seed=m)


@pytest.mark.parametrize("isa", isas())
def test_int8_rotations_and_perm_every_isa(ext, isa):
    for i, (perm, su, sv) in enumerate([(False, False, False), (True, False, False), (True, True, True), (False, True, True)]):
        t = random_layer(96, [F.Segment(64, 5, 32), F.Segment(128, 4, 128), F.Segment(64, 3, 64)], perm=perm, su=su,
                         sv=sv, seed=i)
        for m in (1, 3, 16):
            check(ext, t, m, "int8", isa, seed=m)


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return set()


def test_auto_picks_the_widest_instruction_set(ext):
    names = ext.isa_names()
    flags = cpu_flags()
    if sys.platform.startswith("linux") and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags:
        assert names[-1] == "avx512vnni"
    t = random_layer(8, [F.Segment(64, 4, 32)], seed=0)
    assert kernel(ext, t).isa == names[-1]
    assert kernel(ext, t, names[0]).isa == names[0]


@pytest.mark.parametrize("perm", [False, True])
@pytest.mark.parametrize("su", [False, True])
@pytest.mark.parametrize("sv", [False, True])
def test_forward_rotations_and_perm(ext, perm, su, sv):
    t = random_layer(96, [F.Segment(64, 5, 32), F.Segment(128, 4, 128)], perm=perm, su=su, sv=sv, seed=7)
    for path in ("int8", "fp32", "gemm"):
        check(ext, t, 3, path)


@pytest.mark.parametrize("k", [32, 96, 544, 1536, 2080])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9, 16, 17, 64])
def test_forward_shapes_and_batches(ext, k, m):
    t = random_layer(40, [F.Segment(k, 4, 32)], seed=k + m)
    layer = kernel(ext, t)
    x = torch.randn(m, k)
    want = exact_and_scale(x, t)[0]
    auto = layer.forward(x).double()  # int8 GEMV up to 16 rows, GEMM from 17
    assert torch.allclose(auto, want, rtol=0.05, atol=0.05 * want.abs().max().item())
    check(ext, t, m, "int8")
    check(ext, t, m, "fp32")
    check(ext, t, m, "gemm")


def test_int8_error_is_small_on_gaussian_activations(ext):
    # the documented cost of int8 activations: ~0.5% relative RMS output error
    t = random_layer(576, [F.Segment(576, 4, 32)], seed=3)
    err, want = check(ext, t, 8, "int8")
    rel = (err.norm() / want.norm()).item()
    assert rel < 0.01, rel


# ---------------------------------------------------------------------------------------------
# the module


def test_quant_linear_module_dispatch_and_storage(ext):
    t = random_layer(48, [F.Segment(64, 6, 32), F.Segment(128, 4, 64)], seed=11)
    layer = QuantLinear(t)
    assert (layer.in_features, layer.out_features) == (192, 48)
    assert layer.bits_per_weight == pytest.approx(F.bits_per_weight(t))
    # only the stored tensors, no dequantized copy
    assert {k: (v.dtype, v.shape) for k, v in layer.state_dict().items()} == {k: (v.dtype, v.shape) for k, v in t.items()}
    x = torch.randn(2, 3, 192)
    want = F.reference_forward(x, t)
    got = layer(x)
    assert got.shape == (2, 3, 48) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
    exact = QuantLinear(t, exact=True)(x)
    assert torch.allclose(exact, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    k = layer.kernel()
    big = torch.randn(144, 192)
    assert torch.allclose(k.forward(big, "gemm"), F.reference_forward(big, t), rtol=1e-4, atol=1e-4)
    # the default cutover: the table's own (int8 GEMV below int8_gemm_min_rows, GEMM from it; never on
    # AVX-512 VNNI); exact: fp32 GEMV below 8 rows
    cut = k.int8_gemm_min_rows
    assert layer.gemm_min_rows == cut
    cases = ((cut - 1, "int8"), (cut, "gemm")) if cut < 2**63 - 1 else ((300, "int8"),)
    for m, path in cases:
        xm = torch.randn(m, 192)
        assert torch.equal(layer(xm), k.forward(xm, path)), m
    for m, path in ((7, "fp32"), (8, "gemm")):
        xm = torch.randn(m, 192)
        assert torch.equal(QuantLinear(t, exact=True)(xm), k.forward(xm, path)), m
    bf = layer(x.bfloat16())
    assert bf.dtype == torch.bfloat16
    # a state_dict round trip rebuilds the kernel object from the new buffers
    other = QuantLinear(random_layer(48, [F.Segment(64, 6, 32), F.Segment(128, 4, 64)], seed=12))
    other(x)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other(x), got)


def test_gemm_min_rows_default_per_table(ext):
    """Where dequant + GEMM takes over from the int8 GEMV, measured over a whole model and through the
    generator's prefill (docs/benchmarks.md): 128 rows on the AVX2 table (Zen 3), 64 on AVX-VNNI, never on
    AVX-512 VNNI (Xeon), 17 on the scalar table; a given limit or exact=True overrides the table."""
    t = random_layer(16, [F.Segment(64, 4, 64)], seed=3)
    want = {"avx2": 128, "avxvnni": 64, "avx512vnni": 2**63 - 1, "scalar": 17}
    for isa in isas():
        assert kernel(ext, t, isa).int8_gemm_min_rows == want[isa], isa
    m = QuantLinear(t)
    assert m.gemm_min_rows == 17  # before the kernel exists: the module's stand-in
    m.kernel()
    assert m.gemm_min_rows == kernel(ext, t).int8_gemm_min_rows
    assert QuantLinear(t, exact=True).gemm_min_rows == 8
    assert QuantLinear(t, gemm_min_rows=5).gemm_min_rows == 5
    m.gemm_min_rows = 9
    assert m.gemm_min_rows == 9
    m.gemm_min_rows = None
    assert m.gemm_min_rows == kernel(ext, t).int8_gemm_min_rows


def test_bad_inputs_give_clear_errors(ext):
    t = random_layer(8, [F.Segment(64, 4, 32)], seed=1)
    with pytest.raises(RuntimeError, match="qweight has 31 bytes per row"):
        kernel(ext, dict(t, qweight=t["qweight"][:, :31]))
    with pytest.raises(RuntimeError, match="perm is not a permutation"):
        kernel(ext, dict(t, perm=torch.zeros(64, dtype=torch.int16)))
    with pytest.raises(RuntimeError, match="bits=9"):
        kernel(ext, dict(t, qmeta=torch.tensor([[64, 9, 32]], dtype=torch.int32)))
    with pytest.raises(RuntimeError, match="instruction set 'avx9000' is not available"):
        kernel(ext, t, "avx9000")
    with pytest.raises(RuntimeError, match="in_features=64"):
        kernel(ext, t).forward(torch.randn(2, 63))
    with pytest.raises(ValueError, match="missing \\['qscale'\\]"):
        QuantLinear({"qweight": t["qweight"], "qmeta": t["qmeta"]})


# ---------------------------------------------------------------------------------------------
# building


def test_kernels_run_multithreaded(ext):
    # at::parallel_for is a header template: built without OpenMP it silently runs on one thread
    if torch.get_num_threads() < 2:
        pytest.skip("torch uses one thread here")
    assert ext.parallel_chunks(torch.get_num_threads()) == torch.get_num_threads()


def test_setup_extensions_list_existing_sources():
    exts = build.setup_extensions()  # the CUDA one only where torch has CUDA
    assert exts[0].name == "cuda_ext._exl_cpu" and [e.name for e in exts[1:]] in ([], ["cuda_ext._exl_cuda"])
    root = build.CSRC.parent.parent
    for e in exts:
        assert all((root / s).exists() for s in e.sources), e.sources


@pytest.mark.slow
def test_cuda_sources_compile():
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    res = subprocess.run([sys.executable, "-m", "cuda_ext.compile_check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# Every bit width alone (groups of 1 and 4 blocks), a mix whose segments end inside a quad, and
# every bit width in whole runs of 16 blocks (the avx512 table's unit), runs whose last quad is
# partial (14, 13 blocks) and groups of 3 blocks across runs.
INVARIANCE_MIXES = {
    **{f"{b}-bit": [F.Segment(256, b, 32 if b % 2 else 128)] for b in range(1, 9)},
    "mixed": [F.Segment(512, 4, 128), F.Segment(64, 3, 64), F.Segment(96, 5, 32), F.Segment(32, 8, 32)],
    "runs-1-4": [F.Segment(448, 1, 32), F.Segment(512, 2, 128), F.Segment(928, 3, 32), F.Segment(1024, 4, 64)],
    "runs-5-8": [F.Segment(960, 5, 96), F.Segment(1536, 6, 64), F.Segment(928, 7, 32), F.Segment(448, 8, 32)],
}


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("mix", sorted(INVARIANCE_MIXES))
def test_gemv_gives_each_row_the_same_bits_at_any_batch_size(ext, isa, mix):
    """Batch invariance (the default on every table): a row's output does not depend on how many rows share
    the call, for 1..17 rows and beyond one pass of 16 (what exact speculative decoding needs: drafts are
    verified in one batch). Both GEMV paths; GEMM (from gemm_min_rows rows on) is kept out with a high limit."""
    t = random_layer(37, INVARIANCE_MIXES[mix], seed=len(mix), bias=False)
    k = kernel(ext, t, isa)
    x = torch.randn(20, F.layer_shape(t)[1], generator=torch.Generator().manual_seed(7))
    for path in ("int8", "fp32"):
        alone = torch.cat([k.forward(x[i : i + 1], path, 64, False) for i in range(20)])
        for m in list(range(2, 18)) + [20]:
            got = k.forward(x[:m], path, 64, False)
            bad = [i for i in range(m) if not torch.equal(got[i], alone[i])]
            assert not bad, f"{isa}/{mix}/{path}: rows {bad} of a batch of {m} differ from the row alone"
