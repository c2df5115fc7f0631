"""Running a split model: every rank's runner, the follower loop, and rank 0's `ParallelModel`.

Rank 0 drives: for each forward it sends the inputs and a description of its attention context
to the other ranks (one small message), then every rank runs its part; the collectives inside
the parts (all-reduce, gather, send/recv) connect them. To the caller, `ParallelModel` looks like
a `CausalLM`: forward(input_ids, ctx=..., cache=..., last_only, return_hidden), logits(h), config.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from exl.cache.base import NoCache
from exl.models.base import CausalLM
from exl.parallel.comm import Comm
from exl.parallel.context import CacheKeys, Mirrors, describe, rebuild
from exl.parallel.plan import ParallelError
from exl.parallel.shard import ShardPlan


class Runner:
    """One rank's part of the model and how it takes part in a forward pass."""

    def __init__(self, model: CausalLM, plan: ShardPlan, comm: Comm):
        self.model, self.plan, self.comm = model, plan, comm
        self.mirrors = Mirrors(plan.view_config(), comm.device)

    @torch.inference_mode()
    def forward(self, input_ids, ctx, last_only: bool, return_hidden: bool):
        if self.plan.mode != "layer":
            return self.model(input_ids, ctx=ctx, last_only=last_only, return_hidden=return_hidden)
        return self._pipeline(input_ids, ctx, last_only, return_hidden)

    def _pipeline(self, input_ids, ctx, last_only, return_hidden):
        """Layer split: rank 0 embeds, each rank runs its layers and hands the hidden state on;
        the last rank returns it to rank 0, which holds the final norm and head."""
        m, comm = self.model, self.comm
        rank, last = comm.rank, comm.world - 1
        b, t = input_ids.shape
        shape = (b, t, self.plan.config.hidden_size)
        h = m.embed(input_ids) if rank == 0 else comm.recv(shape, m.dtype, rank - 1)
        for layer in m.layers:
            h = layer(h, ctx)
        ctx.finish()
        tail = last_only and not return_hidden
        if rank < last:
            comm.send(h, rank + 1)
        elif rank:
            comm.send(h[:, -1:] if tail else h, 0)
        if rank:
            return None
        h = comm.recv((b, 1 if tail else t, shape[2]), m.dtype, last)
        return h if return_hidden else m.logits(h)

    @torch.inference_mode()
    def logits(self, h):
        return self.model.logits(h)


def follow(runner: Runner) -> None:
    """A follower's life: run rank 0's commands until it says stop (or disappears)."""
    comm, device = runner.comm, runner.comm.device
    while True:
        cmd = comm.broadcast_object()
        op = cmd[0]
        if op == "stop":
            return
        if op == "forward":
            _, ids, desc, last_only, return_hidden, freed = cmd
            runner.mirrors.free(freed)
            runner.forward(ids.to(device), rebuild(desc, runner.mirrors), last_only, return_hidden)
        elif op == "logits":
            _, shape, dtype = cmd
            runner.logits(comm.broadcast(torch.empty(shape, dtype=dtype, device=device)))
        elif op != "ping":
            raise ParallelError(f"rank {comm.rank}: unknown command {op!r} from rank 0")


class ParallelModel:
    """Rank 0's handle on a model split over several processes; use it like a `CausalLM`.

    `config` describes rank 0's part as caches need it (its KV heads, or its layers), so a cache
    made from it — by the generator or `exl.simple` — holds exactly rank 0's share; the other ranks
    keep matching caches of their own. `full_config` is the whole model's config.
    """

    def __init__(self, runner: Runner, launcher=None, heartbeat: float | None = None):
        self.runner, self.comm, self.plan = runner, runner.comm, runner.plan
        self.launcher = launcher
        model = runner.model
        self.config = self.plan.view_config()
        self.full_config = self.plan.config
        self.dtype, self.device, self.path = model.dtype, model.device, model.path
        self.mode, self.world_size = self.plan.mode, self.comm.world
        self._keys = CacheKeys()
        self._lock = threading.RLock()
        self._broken: str | None = None
        self._closed = False
        self._last = time.monotonic()
        self._heartbeat = heartbeat if heartbeat is not None else self.comm.timeout / 4
        threading.Thread(target=self._beat, name="exl-parallel-heartbeat", daemon=True).start()

    # -- the CausalLM interface -------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, ctx=None, cache=None, last_only: bool = False,
                return_hidden: bool = False) -> torch.Tensor:
        """Logits (float32) for input_ids [B, T]; same arguments as `CausalLM.forward`."""
        if ctx is None:
            b, t = input_ids.shape
            ctx = cache.context(t) if cache is not None else NoCache(b, t, self.device)
        desc = describe(ctx, self._keys)
        with self._command():
            self.comm.broadcast_object(("forward", input_ids.cpu(), desc, last_only, return_hidden,
                                        self._keys.take_freed()))
            return self.runner.forward(input_ids.to(self.device), ctx, last_only, return_hidden)

    __call__ = forward

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and head on hidden states from `forward(..., return_hidden=True)`."""
        if self.mode == "layer" or not self.plan.split_head:  # rank 0 holds the whole head
            return self.runner.logits(h)
        with self._command():
            self.comm.broadcast_object(("logits", tuple(h.shape), h.dtype))
            self.comm.broadcast(h.contiguous())
            return self.runner.logits(h)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.runner.model.embed(input_ids)

    def eval(self) -> "ParallelModel":
        return self

    @property
    def closed(self) -> bool:
        return self._closed

    # -- lifetime ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _command(self):
        with self._lock:
            if self._closed:
                raise ParallelError("the parallel model was closed")
            if self._broken is None and self.launcher is not None:
                self._broken = self.launcher.failure()
            if self._broken:
                raise ParallelError(f"the parallel model cannot run any more: {self._broken}")
            try:
                yield
            except BaseException as e:  # the ranks are out of step now: refuse further work
                self._broken = str(e) or type(e).__name__
                raise
            finally:
                self._last = time.monotonic()

    def _beat(self):
        """Keep idle followers from timing out while they wait for the next command."""
        while not self._closed and not self._broken:
            time.sleep(min(self._heartbeat, 5.0))
            if time.monotonic() - self._last < self._heartbeat or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed and not self._broken:
                    self.comm.broadcast_object(("ping",))
                    self._last = time.monotonic()
            except ParallelError as e:
                self._broken = str(e)
            finally:
                self._lock.release()

    def close(self) -> None:
        """Stop the other ranks and leave the process group. Called at exit if not before."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._broken:
                try:
                    self.comm.broadcast_object(("stop",))
                except ParallelError:
                    pass
            if self.launcher is not None:
                self.launcher.join()
            self.comm.close()
            self.runner.model = None  # free this rank's weights and caches now, not at exit
            self.runner.mirrors.caches.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
