"""The ranks' communication: process groups with timeouts, and collectives that fail loudly.

Tensors travel on the device backend (NCCL between GPUs, gloo on CPUs); commands from rank 0 travel
on a gloo group, so they never need a GPU. Every wait has a timeout, and a rank that died turns
into a `ParallelError` on the others instead of a hang.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from exl.parallel.plan import ParallelError

DEFAULT_TIMEOUT = float(os.environ.get("EXL_PARALLEL_TIMEOUT", "300"))


class Comm:
    """One rank's view of the group: its rank, the world size, its device, and the collectives."""

    def __init__(self, rank: int, world: int, device: torch.device, timeout: float = DEFAULT_TIMEOUT):
        self.rank, self.world, self.device, self.timeout = rank, world, torch.device(device), timeout
        self.data = None  # the default group
        self.ctrl = None
        self.describe_failure = lambda: ""  # rank 0's launcher says which rank died

    @classmethod
    def init(cls, rank: int, world: int, device, init_method: str | None = "env://",
             timeout: float = DEFAULT_TIMEOUT, store=None) -> "Comm":
        """Join the process group (blocks until all `world` ranks have joined, or times out).

        Rendezvous through `init_method` ("env://" reads MASTER_ADDR/MASTER_PORT) or a ready `store`.
        """
        device = torch.device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        comm = cls(rank, world, device, timeout)
        if not dist.is_initialized():
            try:
                where = dict(store=store) if store is not None else dict(init_method=init_method)
                dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout),
                                        **where)
            except Exception as e:  # noqa: BLE001  (torch raises several types for rendezvous failures)
                raise ParallelError(f"rank {rank}: could not join the process group at {init_method or 'the store'} "
                                    f"within {timeout:.0f} s ({e}). Check MASTER_ADDR/MASTER_PORT and that "
                                    f"all {world} ranks were started.") from e
        comm.ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if backend != "gloo" else None
        return comm

    def _run(self, what: str, fn):
        try:
            return fn()
        except RuntimeError as e:  # gloo and NCCL report dead peers and timeouts as RuntimeError (subclasses)
            extra = self.describe_failure()
            raise ParallelError(f"rank {self.rank}: {what} failed: another rank stopped (crashed, was killed, "
                                f"or did not answer within {self.timeout:.0f} s). {extra}\n  ({e})".rstrip()) from e

    # -- commands (rank 0 -> all) -------------------------------------------------------------

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled, on the gloo group)."""
        box = [obj]
        self._run("receiving a command from rank 0" if self.rank else "sending a command",
                  lambda: dist.broadcast_object_list(box, src=0, group=self.ctrl))
        return box[0]

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world
        self._run("exchanging setup data", lambda: dist.all_gather_object(out, obj, group=self.ctrl))
        return out

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into `t` on every rank (same shape and dtype everywhere)."""
        self._run("broadcast", lambda: dist.broadcast(t, src=0, group=self.data))
        return t

    # -- data ---------------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over ranks, in place."""
        t = t.contiguous()
        self._run("all-reduce", lambda: dist.all_reduce(t, group=self.data))
        return t

    def all_gather_last(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's `t` (last dim sizes[rank]) along the last dim, on every rank."""
        pad = max(sizes)
        t = F.pad(t, (0, pad - t.shape[-1])).contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self._run("all-gather", lambda: dist.all_gather(parts, t, group=self.data))
        return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)

    def gather_last(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Like all_gather_last, but only rank 0 gets the result (others get None)."""
        pad = max(sizes)
        t = F.pad(t, (0, pad - t.shape[-1])).contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        self._run("gather", lambda: dist.gather(t, parts, dst=0, group=self.data))
        if self.rank:
            return None
        return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._run(f"send to rank {dst}", lambda: dist.send(t.contiguous(), dst, group=self.data))

    def recv(self, shape, dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self._run(f"receive from rank {src}", lambda: dist.recv(t, src, group=self.data))
        return t

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (a peer may already be gone)
                pass
