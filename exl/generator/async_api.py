"""asyncio front end: the generator's iterate() loop runs in a background thread; each AsyncJob is an async
iterator over its own events.

Delivery: a step's events are handed over when the next step's kernels start (Generator.on_launch): the event loop's
work for them (the server's JSON and socket writes) then runs while the GIL-free kernels do. Waking an asyncio loop
straight from the generator thread made that thread wait for the GIL the loop had just taken, once per token (~0.5 ms
per token of a 7 ms step, measured on the server: its call_soon_threadsafe writes to a socket, which releases the
GIL), so a second thread (the courier) wakes those. A uvloop loop (`exl serve` runs on one) is woken directly: its
wake-up keeps the GIL, and the courier's own wake-up per step cost ~0.07 ms of CPU per token on 2 cores.

On the CPU the constructing thread frees its idle OpenMP threads (exl.threads.release_idle_threads): with the
loading thread's pool alive beside the worker's, libgomp sleeps at every barrier of the worker's prefills.

    agen = AsyncGenerator(generator)
    job = AsyncJob(agen, Job(ids, max_new_tokens=100))
    async for event in job:
        print(event.text, end="")
    await agen.close()     # or agen.close() from synchronous code
"""

from __future__ import annotations

import asyncio
import queue
import threading

from exl.generator.generator import Generator
from exl.generator.job import Event, Job
from exl.threads import release_idle_threads


class AsyncGenerator:
    """Owns a Generator and drives it from one worker thread. Safe to use from any number of coroutines
    (and event loops): requests are passed to the worker through a queue.

    A job that fails on its own ends with an event whose eos_reason is "error" (others run on). If the worker
    thread itself dies, every queued and running job gets such a final event, `error` holds the exception and
    the next submit raises RuntimeError caused by it."""

    def __init__(self, generator: Generator):
        self.generator = generator
        self._requests: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._listeners: dict[int, "AsyncJob"] = {}
        self._closed = False
        self.error: BaseException | None = None  # why the worker thread died, if it did
        self._lock = threading.Lock()  # orders submit() against the worker's failure handling
        self._pending: list[tuple["AsyncJob", object]] = []  # the last step's events, not yet handed over
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (job, event) lists for the courier; None: stop
        generator.on_launch = self._flush
        if generator.cache.device.type == "cpu":  # the model now runs on the worker thread
            release_idle_threads()
        self._courier = threading.Thread(target=self._carry, name="exl-deliver", daemon=True)
        self._courier.start()
        self._thread = threading.Thread(target=self._loop, name="exl-generator", daemon=True)
        self._thread.start()

    # -- called from coroutines -----------------------------------------------------------------------------------

    def submit(self, async_job: "AsyncJob") -> None:
        self.generator.validate(async_job.job)  # bad jobs fail here, in the caller
        with self._lock:
            self._check()
            self._requests.put(("enqueue", async_job))
        self._wake.set()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the generator thread failed ({self.error!r}); make a new AsyncGenerator") \
                from self.error
        if self._closed:
            raise RuntimeError("AsyncGenerator is closed")

    async def call(self, fn):
        """Run `fn()` on the worker thread between two generator steps (so it may use the model the generator
        uses, e.g. to score a prompt) and return its result."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._check()
            self._requests.put(("call", (fn, future)))
        self._wake.set()
        return await future

    def request_cancel(self, async_job: "AsyncJob") -> None:
        self._requests.put(("cancel", async_job))
        self._wake.set()

    def close(self):
        """Cancel everything and stop the worker thread. Awaitable, or callable from sync code."""
        self._closed = True
        self._requests.put(("close", None))
        self._wake.set()
        self._thread.join(timeout=60)
        self._courier.join(timeout=60)
        return _Done()

    @property
    def num_running(self) -> int:
        return self.generator.num_running

    @property
    def num_waiting(self) -> int:
        return self.generator.num_waiting + self._requests.qsize()

    # -- the worker thread ----------------------------------------------------------------------------------------

    def _drain(self) -> bool:
        gen = self.generator
        while True:
            try:
                kind, aj = self._requests.get_nowait()
            except queue.Empty:
                return True
            if kind == "close":
                gen.cancel_all()
                self._dispatch(gen.iterate())
                return False
            if kind == "enqueue":
                try:
                    gen.enqueue(aj.job)
                    self._listeners[id(aj.job)] = aj
                except Exception as e:  # noqa: BLE001 - reported to the job's consumer
                    aj._deliver(e)
            elif kind == "cancel" and id(aj.job) in self._listeners:
                gen.cancel(aj.job)
            elif kind == "call":
                fn, future = aj
                try:
                    result, error = fn(), None
                except Exception as e:  # noqa: BLE001 - raised in the caller
                    result, error = None, e
                _resolve(future, result, error)

    def _dispatch(self, events) -> None:
        """Keep a step's events for the courier (handed over by _flush)."""
        for ev in events:
            aj = self._listeners.get(id(ev.job))
            if aj is None:
                continue
            if ev.eos:
                del self._listeners[id(ev.job)]
            self._pending.append((aj, ev))

    def _flush(self) -> None:
        """Hand the kept events over: straight to uvloop loops (their call_soon_threadsafe signals an eventfd
        without releasing the GIL), the rest to the courier (no GIL released here either: SimpleQueue.put only
        signals its lock; asyncio's own loops write to a socket, which releases it)."""
        if not self._pending:
            return
        direct, courier = [], []
        for pair in self._pending:
            (direct if _wakes_without_gil(pair[0]._loop) else courier).append(pair)
        self._pending = []
        _wake_all(direct)
        if courier:
            self._outbox.put(courier)

    def _loop(self) -> None:
        gen = self.generator
        try:
            while True:
                if not self._drain():
                    break
                if gen.has_work():
                    events = gen.iterate()  # hands over the previous step's events as its kernels start
                    self._flush()  # or here, if it launched none
                    self._dispatch(events)
                else:
                    self._flush()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - every waiting consumer gets a final error event
            self._flush()
            self._fail_all(e)
        finally:
            self._flush()
            with self._lock:
                self._closed = True
                left = list(self._listeners.values()) + self._take_queued()
            for aj in left:
                aj._deliver(RuntimeError("AsyncGenerator closed"))
            self._listeners.clear()
            self._outbox.put(None)

    def _carry(self) -> None:
        """The courier: wakes each event loop once for whatever has been handed over since it last looked."""
        while True:
            batches = [self._outbox.get()]
            while True:
                try:
                    batches.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            _wake_all([pair for batch in batches for pair in batch or ()])
            if None in batches:
                return

    def _take_queued(self) -> list["AsyncJob"]:
        """Remove and return the jobs whose enqueue request the worker has not taken yet."""
        out = []
        while True:
            try:
                kind, aj = self._requests.get_nowait()
            except queue.Empty:
                return out
            if kind == "enqueue":
                out.append(aj)
            elif kind == "call":
                _resolve(aj[1], None, RuntimeError("AsyncGenerator closed"))

    def _fail_all(self, error: BaseException) -> None:
        """The worker is dying: end every running and still-queued job with an error event, so none hangs."""
        with self._lock:  # after this, submit() raises instead of queueing
            self.error = error
            pending = self._take_queued()
        try:  # free the pages if the generator still can
            self.generator.cancel_all()
            self.generator.iterate()
        except Exception:  # noqa: BLE001 - best effort; the error events go out regardless
            pass
        message = f"the generator thread failed: {type(error).__name__}: {error}"
        for aj in list(self._listeners.values()) + pending:
            aj._deliver(_error_event(aj.job, message))
        self._listeners.clear()


def _put_all(items) -> None:
    for aj, item in items:
        aj._put(item)


def _wake_all(pairs) -> None:
    """Each (job, event) pair's loop runs _put_all on its pairs, in order; one wake-up per loop."""
    by_loop: dict = {}
    for aj, item in pairs:
        by_loop.setdefault(aj._loop, []).append((aj, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that loop is closed: nobody is listening
            pass


def _wakes_without_gil(loop) -> bool:
    """A uvloop loop: its call_soon_threadsafe (uv_async_send) keeps the GIL, so the generator thread may call
    it directly, saving the courier's wake-up per step (~0.07 ms of CPU per token on 2 cores)."""
    return type(loop).__module__.startswith("uvloop")


def _resolve(future: asyncio.Future, result, error) -> None:
    """Complete a caller's future from the worker thread."""

    def done():
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(done)
    except RuntimeError:  # the caller's loop is closed
        pass


def _error_event(job: Job, message: str) -> Event:
    job.status, job.eos_reason, job.error = "done", "error", message
    return Event(job=job, identifier=job.identifier, eos=True, eos_reason="error", error=message,
                 prompt_tokens=len(job.input_ids), new_tokens=len(job.generated))


class _Done:
    """Awaitable that is already complete (lets close() be awaited or called plainly)."""

    def __await__(self):
        return iter(())


class AsyncJob:
    """An async iterator over one job's events (the last has eos=True). Create it inside a running event loop.

    With `sink` (an asyncio.Queue of that loop), the job is not iterated: each of its events, or the exception
    that ends it, is put into `sink` as `(tag, item)`. Many jobs can share one sink, so that a consumer of
    several jobs waits on one queue (no task per job between the generator and the consumer)."""

    def __init__(self, async_generator: AsyncGenerator, job: Job, *, sink: asyncio.Queue | None = None, tag=None):
        self.generator, self.job = async_generator, job
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue | None = asyncio.Queue() if sink is None else None
        self._sink, self._tag = sink, tag
        self._finished = False
        async_generator.submit(self)

    def _deliver(self, item) -> None:  # from the worker thread, at once (errors; not a step's events)
        self.generator._outbox.put([(self, item)])

    def _put(self, item) -> None:  # in the job's event loop
        if self._sink is None:
            self._queue.put_nowait(item)
            return
        if isinstance(item, BaseException) or item.eos:
            self._finished = True
        self._sink.put_nowait((self._tag, item))

    def __aiter__(self):
        if self._sink is not None:
            raise TypeError("an AsyncJob made with a sink delivers its events there; it cannot be iterated")
        return self

    async def __anext__(self):
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        if item.eos:
            self._finished = True
        return item

    async def cancel(self) -> None:
        """Stop the job and free its pages; iteration then ends with an event whose eos_reason is "cancelled"."""
        if not self._finished:
            self.generator.request_cancel(self)
