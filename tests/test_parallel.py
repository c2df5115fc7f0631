"""Multi-process inference on CPUs (gloo): tensor-, expert- and layer-parallel models against the
single-process model.

Each case spawns 2 or 4 ranks and checks, in fp32: full-forward logits within 1e-4 of the single
process, and greedy generation through the dynamic generator (paged cache) token for token.
Quantized weights run the exact fp32 CPU path (EXL_CPU_EXACT=1) on both sides.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import exl
from exl import format as F
from exl.generator import Generator, Job, PagedCache, SamplerSettings
from exl.parallel import ParallelError, load_parallel

pytestmark = pytest.mark.timeout(300)

VOCAB = 211
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False)
FAMILIES = {
    "dense": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=None)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=2, head_dim=16,
                                                               moe_intermediate_size=64, mlp_only_layers=[1])),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=64,
                                                               shared_expert_intermediate_size=96)),
}
ROUTERS = (".gate", ".shared_expert_gate")


@pytest.fixture(scope="module", autouse=True)
def exact_cpu_kernels():
    old = os.environ.get("EXL_CPU_EXACT")
    os.environ["EXL_CPU_EXACT"] = "1"  # inherited by the ranks
    yield
    if old is None:
        del os.environ["EXL_CPU_EXACT"]
    else:
        os.environ["EXL_CPU_EXACT"] = old


def make_family(path, family, seed=0):
    cfg_cls, model_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + 1.0 if "norm" in n else torch.randn_like(p) * 0.08)
    model.save_pretrained(path)
    return path


def quantize_weight(w, seed, perm=True, su=True, sv=True):
    """Round-to-nearest into the exl format: Hadamard rotations, act-order-style permutation, 6/4-bit mix."""
    g = torch.Generator().manual_seed(seed)
    n, k = w.shape
    rest = k - 32
    segs = [F.Segment(32, 6, 32), F.Segment(rest, 4, 64 if rest % 64 == 0 else 32)]
    wh, t = w.double(), {}
    if su:
        s = (torch.randint(0, 2, (k,), generator=g) * 2 - 1).double()
        t["su"], wh = F.pack_signs(s), F.fwht(wh * s)
    if sv:
        s = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).double()
        t["sv"], wh = F.pack_signs(s), F.fwht((s[:, None] * wh).T).T
    if perm:
        p = torch.randperm(k, generator=g)
        t["perm"], wh = p.to(F.perm_dtype(k)), wh[:, p]
    bits, groups = F.group_bits_and_offsets(segs)
    centre = (2.0 ** bits.double() - 1) / 2
    amax = torch.zeros(n, int(groups.max()) + 1, dtype=torch.float64)
    amax = amax.scatter_reduce(1, groups.expand(n, -1), wh.abs(), "amax")
    scale = (amax / centre[torch.searchsorted(groups, torch.arange(amax.shape[1]))]).clamp_min(1e-6).half()
    codes = torch.round(wh / scale.double()[:, groups] + centre).clamp(torch.zeros(k), 2.0**bits - 1)
    t.update(qweight=F.pack_codes(codes.to(torch.uint8), segs), qscale=scale, qmeta=F.segments_to_meta(segs))
    return t


def quantize_folder(src, dst, layers=None):
    """An exl-format copy of a dense folder: every decoder linear and the head quantized. Different
    layer kinds take different options, so every splitting path is exercised. layers: keep only the
    first N decoder layers."""
    dst.mkdir()
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    if layers is not None:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    out = {}
    for i, (name, w) in enumerate(sorted(tensors.items())):
        prefix = name.removesuffix(".weight")
        kind = prefix.rsplit(".", 1)[-1]
        if name.endswith(".weight") and w.dim() == 2 and "embed" not in name and not prefix.endswith(ROUTERS):
            opts = dict(perm=kind not in ("o_proj", "down_proj", "w2"), su=kind not in ("down_proj", "w2"))
            for suffix, v in quantize_weight(w, i, **opts).items():
                out[f"{prefix}.{suffix}"] = v
        else:
            out[name] = w
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl", "version": 1}
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    out = {f: make_family(root / f, f) for f in FAMILIES}
    out["quant"] = quantize_folder(out["dense"], root / "quant")
    return out


PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)]
IDS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))


def greedy(model, new=8):
    gen = Generator(model, PagedCache(model, num_pages=24, page_size=8), None, max_batch_size=2, max_chunk_size=16)
    jobs = [Job(p, max_new_tokens=new, sampler=SamplerSettings.greedy()) for p in PROMPTS]
    gen.enqueue(jobs)
    while gen.has_work():
        gen.iterate()
    return [j.generated for j in jobs]


_single_cache = {}


def single(path):
    """The single-process model's logits on IDS and its greedy generations."""
    if path not in _single_cache:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matrices: OpenMP hand-offs cost more than they save (and vary with load)
        try:
            model = exl.load_model(path, progress=False)
            _single_cache[path] = (model(IDS), greedy(model))
        finally:
            torch.set_num_threads(threads)
    return _single_cache[path]


def check_close(ours, theirs, tol=1e-4):
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err <= tol, f"max relative difference {err:.3e} > {tol}"


def check_parallel(path, **kwargs):
    want_logits, want_tokens = single(path)
    with load_parallel(path, device="cpu", progress=False, timeout=60, **kwargs) as model:
        check_close(model(IDS), want_logits)
        assert greedy(model) == want_tokens
        return model.plan


CASES_2 = [
    ("dense", dict(tp=2, shares=[1, 2])),
    ("quant", dict(tp=2, shares=[1, 2])),
    ("mixtral", dict(tp=2, mode="expert")),
    ("mixtral", dict(tp=2, mode="tensor", shares=[2, 1])),
    ("qwen3-moe", dict(tp=2, mode="expert", shares=[1, 2])),
    ("qwen3-moe", dict(tp=2, mode="tensor")),
    ("qwen2-moe", dict(tp=2, mode="tensor")),
    ("dense", dict(tp=2, mode="layer")),
    ("quant", dict(tp=2, mode="layer")),
]
CASES_4 = [
    ("dense", dict(tp=4)),
    ("quant", dict(tp=4, shares=[1, 2, 1, 1])),
    ("mixtral", dict(tp=4, mode="expert")),
    ("qwen3-moe", dict(tp=4, mode="expert")),
]


@pytest.mark.parametrize("family,kwargs", CASES_2 + CASES_4,
                         ids=[f"{f}-{k.get('mode', 'tensor')}-tp{k['tp']}" for f, k in CASES_2 + CASES_4])
def test_parallel_equals_single_process(folders, family, kwargs):
    plan = check_parallel(folders[family], **kwargs)
    if plan.mode == "layer":
        assert [len(r) for r in plan.all_layers] in ([2, 1], [1, 2])


def test_uneven_shares_give_uneven_parts(folders):
    load = exl.load_model(folders["qwen3-moe"], device="cpu", progress=False, tp=2, mode="expert", shares=[1, 2])
    with load as m:
        assert m.plan.kv_ranges == [(0, 1), (1, 4)]
        assert m.plan.local_experts == range(0, 2)  # 6 experts, 1:2
        assert m.config.num_kv_heads == 1 and m.full_config.num_kv_heads == 4  # rank 0's cache holds its heads
        check_close(m(IDS), single(folders["qwen3-moe"])[0])


def test_a_dead_rank_stops_rank_0_with_a_clear_error(folders):
    model = load_parallel(folders["dense"], tp=2, device="cpu", progress=False, timeout=30)
    try:
        model.launcher.procs[0].kill()
        model.launcher.procs[0].wait()
        t0 = time.monotonic()
        with pytest.raises(ParallelError, match="rank 1"):
            model(IDS)
        assert time.monotonic() - t0 < 10
        with pytest.raises(ParallelError, match="cannot run any more"):
            model(IDS)
    finally:
        model.close()


def test_followers_stop_when_rank_0_dies(folders, tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        from exl.parallel import load_parallel
        m = load_parallel({str(folders['dense'])!r}, tp=2, device="cpu", progress=False)
        print(m.launcher.procs[0].pid, flush=True)
        os._exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("rank 1 kept running after rank 0 died")


@pytest.mark.slow
def test_a_hung_rank_times_out(folders):
    model = load_parallel(folders["dense"], tp=2, device="cpu", progress=False, timeout=5)
    pid = model.launcher.procs[0].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(ParallelError, match="did not answer within 5 s"):
            model(IDS)
    finally:
        os.kill(pid, signal.SIGKILL)
        model.close()


def test_bad_requests_fail_before_any_process_starts(folders):
    with pytest.raises(ParallelError, match="at least 2"):
        load_parallel(folders["dense"], tp=1)
    with pytest.raises(exl.errors.ModelLoadError):
        load_parallel(folders["dense"] / "missing", tp=2)
    with pytest.raises(ParallelError, match="no experts"):
        load_parallel(folders["dense"], tp=2, mode="expert", device="cpu", progress=False)
    with pytest.raises(ParallelError, match="cannot split 4 KV heads over 5"):
        load_parallel(folders["dense"], tp=5, device="cpu", progress=False)


# -- SmolLM2 (real weights) ----------------------------------------------------------------------------------------

TEXT = """The history of the printing press begins in the fifteenth century, when movable type made books cheap
enough for ordinary readers. Within fifty years presses were at work in more than two hundred cities, and the
number of books in Europe grew from thousands to millions. Scholars could compare identical copies of a text,
errors could be corrected in the next edition, and ideas travelled faster than any messenger on horseback.
Printers became publishers, booksellers and sometimes censors; governments learned to license them. The same
machine that spread scripture also spread pamphlets, almanacs, maps and the first newspapers."""


def test_smollm2_tensor_parallel_uneven(smollm_dir):
    plan = check_parallel(smollm_dir, tp=2, shares=[1, 2])
    assert plan.kv_ranges == [(0, 1), (1, 3)]


def test_eval_ppl_with_tp_matches_single_process(smollm_dir, tmp_path, capsys):
    from exl.cli import main
    from exl.parallel import close_all

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = ["eval", "ppl", "-m", str(smollm_dir), "--text", str(text), "--ctx", "48", "--max-windows", "2", "--json"]
    results, threads = [], torch.get_num_threads()
    for extra in ([], ["--tp", "2"]):
        torch.set_num_threads(1)  # as each of the 2 ranks runs (2 cores); the numbers do not depend on it
        try:
            assert main(args + extra) == 0
        finally:
            close_all()
            torch.set_num_threads(threads)
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    one, two = results
    assert one["tokens"] == two["tokens"] == 2 * 47
    assert abs(two["ppl"] - one["ppl"]) <= 1e-4 * one["ppl"], (one, two)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_smollm2_quantized_tensor_parallel(smollm_dir, tmp_path, tp):
    """Real SmolLM2 shapes (9 query / 3 KV heads of 64, 1536 MLP channels, tied 49152 head), 4 layers
    quantized with rotations and act-order; 3 ranks get one KV head each."""
    path = quantize_folder(smollm_dir, tmp_path / "q", layers=4)
    check_parallel(path, tp=tp)
