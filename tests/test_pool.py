"""exl's CPU thread pool (cuda_ext/csrc/cpu_pool.h): the same chunks as at::parallel_for, errors that reach
the caller, and the one-call decode step running on it from any thread — the server's generator thread
included, where OpenMP alone (a second thread team) collapsed decode from ~200 to ~43 tokens/s on 2 cores."""

import threading

import pytest
import torch

import exl
from cuda_ext import build
from exl.generator import AsyncGenerator, AsyncJob, Generator, Job, PagedCache, SamplerSettings
from exl.threads import release_idle_threads

pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def ext():
    return build.load_cpu()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_pool_chunks_are_at_parallel_fors(ext, threads, n_threads):
    threads(n_threads)
    for begin, end, grain in [(0, 100, 10), (0, 7, 1), (5, 1000, 0), (3, 4, 1), (0, 64, 64), (0, 65, 64),
                              (10, 10, 1), (0, 1 << 20, 16), (7, 33, 3)]:
        want = ext.parallel_partition(begin, end, grain, team=False)
        assert ext.parallel_partition(begin, end, grain, team=True) == want, (begin, end, grain)
        if end > begin:  # the chunks tile the range exactly
            assert want[0][0] == begin and want[-1][1] == end
            assert all(a[1] == b[0] for a, b in zip(want, want[1:]))


def test_pool_error_reaches_the_caller_and_the_pool_goes_on(ext, threads):
    threads(2)
    before = ext.team_regions()
    with pytest.raises(RuntimeError, match=r"chunk \[50, 100\) failed on purpose"):
        ext.parallel_partition(0, 100, 1, team=True, throw_at=77)
    assert ext.parallel_partition(0, 100, 1, team=True) == [(0, 50), (50, 100)]
    assert ext.team_regions() == before + 2


def _greedy(gen, ids, n):
    job = Job(ids, max_new_tokens=n, sampler=SamplerSettings.greedy(), ignore_eos=True)
    gen.enqueue(job)
    while not job.eos_reason:
        gen.iterate()
    return job.generated


@pytest.fixture(scope="module")
def smol_q4(tmp_path_factory):
    from test_generator import rtn_quantized

    from exl.assets import smollm2_dir

    return exl.load_model(rtn_quantized(smollm2_dir(), tmp_path_factory.mktemp("smol-q4") / "m"), progress=False)


def test_decode_runs_on_the_pool_from_any_thread(ext, threads, smol_q4):
    """The quantized model decoded in the main thread, in a plain thread and behind an AsyncGenerator (after the main
    thread opened its own OpenMP team) gives the same tokens, and every decode step runs on the pool."""
    threads(2)
    model = smol_q4
    ids = list(range(100, 120))

    def fresh():
        return Generator(model, PagedCache(model, max_tokens=256), None)

    torch.ones(1 << 22).sum()  # the main thread's own OpenMP team exists from here on
    before = ext.team_regions()
    want = _greedy(fresh(), ids, 12)
    per_step = (ext.team_regions() - before) / 11  # 11 decode steps after the prefill's token
    assert per_step >= model.config.num_layers  # several regions a block, all on the pool

    got = {}
    t = threading.Thread(target=lambda: got.setdefault("thread", _greedy(fresh(), ids, 12)))
    t.start()
    t.join()

    async def streamed():
        agen = AsyncGenerator(fresh())
        job = AsyncJob(agen, Job(ids, max_new_tokens=12, sampler=SamplerSettings.greedy(), ignore_eos=True))
        tokens = [tok async for ev in job for tok in ev.token_ids]
        await agen.close()
        return tokens

    import asyncio

    before = ext.team_regions()
    got["async"] = asyncio.run(streamed())
    assert ext.team_regions() - before >= 11 * model.config.num_layers
    assert got == {"thread": want, "async": want}



@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quant"])
def test_a_batch_past_the_gemm_threshold_decodes_in_the_team(tmp_path, ext, threads, quantized):
    """20 sequences in one decode step (the quantized layers' GEMM path, split over the team; float layers on
    one thread of it), under inference mode as in the generator: the logits of the module path, bit for bit."""
    from test_decode_step import decode_logits, g, quantize_randomly, spy_step
    from test_models import BASE, make_model

    threads(2)
    _, path = make_model(tmp_path, "llama")
    model = exl.load_model(path, progress=False)
    if quantized:
        quantize_randomly(model)
        from exl.modules.quant_linear import QuantLinear

        for m in model.modules():  # past the GEMM threshold on every table (the AVX2 table's own is 128 rows)
            if isinstance(m, QuantLinear):
                m.gemm_min_rows = 17
    ids = torch.randint(0, BASE["vocab_size"], (60,), generator=g(5)).tolist()
    prompts = [ids[i : i + 3] for i in range(20)]
    with torch.inference_mode():
        ran = spy_step(model)
        before = ext.team_regions()
        got = decode_logits(model, prompts, steps=3, page_size=8)
        assert ran == [False] + [True] * 3
        assert ext.team_regions() > before or not quantized  # (the tiny float model's loops are all under grain)
        del model.decode_step
        model._step = False  # block by block
        want = decode_logits(model, prompts, steps=3, page_size=8)
    assert torch.equal(got, want)


def _runtime_can_pause() -> bool:
    import ctypes

    gomp = [line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line]
    return bool(gomp) and hasattr(ctypes.CDLL(gomp[0]), "omp_pause_resource_all")


def test_release_idle_threads_frees_the_pool_and_regions_go_on(ext, threads):
    """The loading thread frees its OpenMP pool before a generator thread takes the model (exl.threads); parallel
    regions opened afterwards start a new pool and split work as before."""
    threads(2)
    before = ext.parallel_partition(0, 1 << 20, 16, team=False)  # opens a region: this thread has a pool
    assert len(before) == 2
    released = ext.release_idle_threads()
    if not _runtime_can_pause():
        assert released is False
        pytest.skip("this OpenMP runtime has no omp_pause_resource_all")
    assert released is True
    assert ext.parallel_partition(0, 1 << 20, 16, team=False) == before
    out = {}
    t = threading.Thread(target=lambda: out.update(chunks=ext.parallel_partition(0, 1 << 20, 16, team=False),
                                                   freed=release_idle_threads()))
    t.start()
    t.join()
    assert out == {"chunks": before, "freed": True}
