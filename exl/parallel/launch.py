"""Starting the ranks: one process per device, started by exl itself, by `torchrun`, or by hand on
several machines through the standard RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables.

    model = load_parallel("model-dir", tp=2)                 # exl starts rank 1 itself
    model = load_parallel("model-dir", gpu_split=[10, 24])   # layer split, GiB per device
    torchrun --nproc-per-node 2 -m exl.cli serve -m model-dir --tp 2
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from exl.config import ModelConfig
from exl.errors import ExlError
from exl.loader import TensorLoader
from torch.distributed import TCPStore
from exl.parallel.comm import DEFAULT_TIMEOUT, Comm
from exl.parallel.model import ParallelModel, Runner, follow
from exl.parallel.plan import GiB, ParallelError, place_layers
from exl.parallel.shard import MODES, ShardPlan, build_shard

RESERVE_GIB = 1.0  # free memory left on each device for the cache and activations (automatic layer split)


# -- command line --------------------------------------------------------------------------------


def parse_gpu_split(text: str) -> list[float]:
    """'10,24' -> [10.0, 24.0] (GiB per device)."""
    try:
        out = [float(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--gpu-split takes GiB per device separated by commas (e.g. 10,24), got {text!r}") from None
    if not out or any(x <= 0 for x in out):
        raise ValueError(f"--gpu-split figures must be positive GiB, got {text!r}")
    return out


def add_parallel_arguments(parser) -> None:
    """Add --device, --tp, --gpu-split and --parallel-mode to a command's argument parser."""
    import argparse

    def split_type(text):
        try:
            return parse_gpu_split(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parser.add_argument("--device", default=None,
                        help="torch device, e.g. cuda:0 or cpu (default: cuda if a GPU is visible, else cpu)")
    g = parser.add_argument_group("multiple devices (docs/parallel.md)")
    g.add_argument("--tp", type=int, default=None, metavar="N",
                   help="split the model over N devices, one process each (tensor parallel by default)")
    g.add_argument("--gpu-split", type=split_type, default=None, metavar="GiB,GiB,...",
                   help="memory per device: alone, places layers in order (layer split); with --tp, sets "
                        "each device's share of the tensor split")
    g.add_argument("--parallel-mode", choices=("auto",) + MODES, default="auto",
                   help="tensor: split every layer; expert: whole MoE experts per device; layer: layers in "
                        "order. auto: layer with --gpu-split alone, else tensor")


# -- the plan ------------------------------------------------------------------------------------

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _tensor_bytes(loader: TensorLoader, name: str, dtype: torch.dtype) -> int:
    shape, kind = loader.info(name)
    size = torch.empty((), dtype=dtype).element_size() if kind in ("F64", "F32", "BF16") else _ITEMSIZE.get(kind, 4)
    n = 1
    for s in shape:
        n *= s
    return n * size


def layer_bytes(path, num_layers: int, dtype: torch.dtype) -> tuple[list[int], int]:
    """(bytes of each decoder layer, bytes of embedding + head + final norm) at run time."""
    loader = TensorLoader(path)
    per = [0] * num_layers
    rest = 0
    for name in loader.keys():
        nbytes = _tensor_bytes(loader, name, dtype)
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) < num_layers:
            per[int(parts[2])] += nbytes
        else:
            rest += nbytes
    return per, rest


def make_plan(rank: int, world: int, opts: dict, free: list[int | None]) -> ShardPlan:
    """Every rank computes the same plan from the same options and the gathered free memory."""
    config = ModelConfig.from_dir(opts["path"])
    mode, split_gib = opts["mode"], opts.get("gpu_split")
    if split_gib is not None and len(split_gib) != world:
        raise ParallelError(f"--gpu-split gives {len(split_gib)} figures for {world} devices: give one GiB figure per device")
    if mode == "layer":
        sizes, rest = layer_bytes(opts["path"], config.num_layers, opts["dtype"])
        fixed = [rest] + [0] * (world - 1)  # rank 0 embeds and holds the head
        if split_gib:
            budgets, balanced = [int(g * GiB) for g in split_gib], False
        elif all(f is not None for f in free):
            budgets, balanced = [max(int(f - RESERVE_GIB * GiB), 0) for f in free], True
        else:
            budgets, balanced = [sum(sizes) + rest] * world, True
        placement = place_layers(sizes, budgets, fixed, balanced)
        return ShardPlan("layer", rank, world, [1.0] * world, config, layers=placement.layers[rank],
                         all_layers=placement.layers)
    shares = opts.get("shares") or split_gib
    if not shares:
        shares = [float(f) for f in free] if all(f for f in free) else [1.0] * world
    if len(shares) != world:
        raise ParallelError(f"{len(shares)} device shares given for {world} devices")
    plan = ShardPlan(mode, rank, world, [float(s) for s in shares], config, split_head=opts.get("split_head", True))
    plan.kv_ranges  # noqa: B018  (fails early, with a clear message, when the heads cannot be split)
    if mode == "expert":
        if not config.num_experts:
            raise ParallelError(f"{opts['path']}: expert parallelism needs a mixture-of-experts model; "
                                f"{config.architecture} has no experts (use --parallel-mode tensor)")
        plan.local_experts  # noqa: B018
    return plan


# -- one rank ------------------------------------------------------------------------------------


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return None


def _device(opts: dict, local_rank: int) -> torch.device:
    want = opts.get("device")
    if want == "cpu" or (want is None and not torch.cuda.is_available()):
        return torch.device("cpu")
    if torch.cuda.device_count() <= local_rank:
        raise ParallelError(f"local rank {local_rank} needs GPU {local_rank}, but {torch.cuda.device_count()} are visible")
    return torch.device("cuda", local_rank)


def build_kernels(path, device: torch.device) -> None:
    """Build (or load the cached) quantized-layer kernels now, before any rank waits on another:
    a first-time compile takes about a minute."""
    config = ModelConfig.from_dir(path)
    if config.quantization:
        import cuda_ext

        cuda_ext.cuda() if device.type == "cuda" else cuda_ext.cpu()


def start_rank(rank: int, world: int, local_rank: int, opts: dict | None, init_method: str | None = "env://",
               store=None) -> Runner:
    """Join the group, agree on rank 0's options, and load this rank's part (all ranks or none)."""
    device = _device(opts or {}, local_rank)
    if opts:
        build_kernels(opts["path"], device)
    comm = Comm.init(rank, world, device, init_method, (opts or {}).get("timeout", DEFAULT_TIMEOUT), store)
    opts = comm.broadcast_object(opts if rank == 0 else None)
    free = comm.all_gather_object(_free_bytes(device))
    model = plan = None
    try:
        plan = make_plan(rank, world, opts, free)
        dtype = opts["dtype"] or (torch.float16 if device.type == "cuda" else torch.float32)
        model = build_shard(opts["path"], plan, comm, dtype, device, progress=opts.get("progress", False) and rank == 0)
        error = None
    except ExlError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001  (report any failure to every rank instead of hanging them)
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    errors = comm.all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        comm.close()
        raise ParallelError("loading the model failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed))
    return Runner(model, plan, comm)


class Launcher:
    """Rank 0's handle on the rank processes it started: notices when one dies, joins them at the end."""

    def __init__(self, procs: list[subprocess.Popen], threads_before: int | None):
        self.procs, self.threads_before, self.closing = procs, threads_before, False

    def failure(self) -> str | None:
        if self.closing:
            return None
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return (f"rank {rank} (pid {p.pid}) exited with code {p.returncode}; see its error output above. "
                        "Load the model again to continue.")
        return None

    def describe(self) -> str:
        deadline = time.monotonic() + 2.0  # a peer that just closed its sockets may still be exiting
        while time.monotonic() < deadline:
            msg = self.failure()
            if msg:
                return msg
            time.sleep(0.05)
        return ""

    def wait_ready(self, store, timeout: float) -> None:
        """Wait until every started rank has reached the store, failing fast if one dies on the way."""
        deadline = time.monotonic() + timeout
        for rank in range(1, len(self.procs) + 1):
            while not store.check([f"exl/ready/{rank}"]):
                msg = self.failure()
                if msg:
                    raise ParallelError(f"starting the ranks failed: {msg}")
                if time.monotonic() > deadline:
                    raise ParallelError(f"rank {rank} did not start within {timeout:.0f} s")
                time.sleep(0.05)

    def join(self, timeout: float = 30.0) -> None:
        self.closing = True
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.threads_before:
            torch.set_num_threads(self.threads_before)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_rank() -> tuple[int, int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        return rank, world, local
    return None


# -- the entry point -----------------------------------------------------------------------------


def load_parallel(path: str | Path, tp: int | None = None, gpu_split: list[float] | str | None = None,
                  mode: str = "auto", *, shares: list[float] | None = None, dtype: torch.dtype | None = None,
                  device: str | None = None, split_head: bool = True, timeout: float = DEFAULT_TIMEOUT,
                  progress: bool = True, exit_followers: bool = True) -> ParallelModel | None:
    """Load a model split over several devices, one process per device; returns rank 0's handle.

    tp: number of devices (processes). gpu_split: GiB per device — alone it means a layer split
    (layers placed in order within those budgets); with tp it sets each device's share of the
    tensor split. mode: "tensor", "expert" (MoE: whole experts per device), "layer" or "auto".
    shares: explicit relative device sizes (default: free GPU memory, or equal on CPUs).

    Started normally, exl starts ranks 1..tp-1 itself. Under torchrun (or with RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT set by hand on each machine) every process calls this; rank 0 gets
    the model, the others serve it until rank 0 closes it and then exit (or, with
    exit_followers=False, return None).
    """
    if isinstance(gpu_split, str):
        gpu_split = parse_gpu_split(gpu_split)
    _OPEN[:] = [m for m in _OPEN if not m.closed]
    if _OPEN:
        raise ParallelError("a parallel model is already loaded in this process: close it first (model.close() "
                            "or exl.parallel.close_all())")
    env = _env_rank()
    if env is None:
        world = tp if tp and tp > 1 else len(gpu_split or [])
        if world < 2:
            raise ParallelError("a parallel model needs at least 2 devices: pass tp=N (N ≥ 2) or a --gpu-split "
                                "with one figure per device")
    else:
        world = env[1]
        if tp and tp > 1 and tp != world:
            raise ParallelError(f"--tp {tp} does not match WORLD_SIZE={world} set by the launcher")
    if mode in (None, "auto"):
        mode = "layer" if (not tp or tp == 1) and gpu_split else "tensor"
    if mode not in MODES:
        raise ParallelError(f"parallel mode {mode!r} is not one of auto, {', '.join(MODES)}")
    path = Path(path).resolve()
    ModelConfig.from_dir(path)  # a bad folder fails here, before any process starts
    opts = dict(path=str(path), mode=mode, gpu_split=gpu_split, shares=shares, dtype=dtype, device=device,
                split_head=split_head, timeout=timeout, progress=progress)
    make_plan(0, world, opts, [None] * world)  # an impossible split fails here, before any process starts

    if env is not None:
        rank, world, local = env
        runner = start_rank(rank, world, local, opts)
        if rank == 0:
            return _finish(ParallelModel(runner))
        try:
            follow(runner)
        finally:
            runner.comm.close()
        if exit_followers:
            raise SystemExit(0)
        return None

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or _free_port())
    build_kernels(path, _device(opts, 0))  # once, here, so that the ranks find them built
    cpu = _device(opts, 0).type == "cpu"
    threads_before = torch.get_num_threads() if cpu else None
    threads = max(1, (os.cpu_count() or world) // world) if cpu else None
    store = TCPStore(addr, port, world, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    payload = pickle.dumps(dict(rank_addr=addr, port=port, world=world, opts=opts, ppid=os.getpid(), threads=threads))
    procs = []
    for r in range(1, world):
        p = subprocess.Popen([sys.executable, "-m", "exl.parallel.worker", str(r)], stdin=subprocess.PIPE)
        p.stdin.write(payload)
        p.stdin.close()
        procs.append(p)
    launcher = Launcher(procs, threads_before)
    try:
        launcher.wait_ready(store, timeout)
        if threads:
            torch.set_num_threads(threads)
        runner = start_rank(0, world, 0, opts, None, store)
    except BaseException:
        for p in procs:
            p.kill()
        launcher.join(timeout=10)
        raise
    runner.comm.describe_failure = launcher.describe
    return _finish(ParallelModel(runner, launcher))


_OPEN: list[ParallelModel] = []


def _finish(model: ParallelModel) -> ParallelModel:
    _OPEN.append(model)
    atexit.register(model.close)
    return model


def close_all() -> None:
    """Close every parallel model this process opened (the CLI's models stay open until exit)."""
    while _OPEN:
        _OPEN.pop().close()
