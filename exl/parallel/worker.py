"""A rank that exl started itself (`python -m exl.parallel.worker RANK`, settings pickled on stdin).

It joins rank 0's store, loads its part of the model and follows rank 0's commands until told to
stop; it stops by itself, with a message, when rank 0's process goes away.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from datetime import timedelta


def _watch_parent(ppid: int) -> None:
    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != ppid:
                print(f"exl parallel: rank 0 (pid {ppid}) exited; stopping this rank", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="exl-parent-watch", daemon=True).start()


def main(rank: int) -> int:
    job = pickle.loads(sys.stdin.buffer.read())
    _watch_parent(job["ppid"])

    import torch
    from torch.distributed import TCPStore

    from exl.parallel.launch import start_rank
    from exl.parallel.model import follow
    from exl.parallel.plan import ParallelError

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    timeout = timedelta(seconds=job["opts"]["timeout"])
    store = TCPStore(job["rank_addr"], job["port"], job["world"], is_master=False, timeout=timeout)
    store.set(f"exl/ready/{rank}", "1")
    try:
        runner = start_rank(rank, job["world"], rank, job["opts"], None, store)
    except ParallelError:
        return 1  # rank 0 reports every rank's load error
    try:
        follow(runner)
    except ParallelError as e:
        print(f"exl parallel: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        runner.comm.close()
    return 0


if __name__ == "__main__":
    code = main(int(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (seconds with torch loaded); nothing is left to write
