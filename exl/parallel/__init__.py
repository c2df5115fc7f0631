"""Multi-device inference: tensor parallel, expert parallel and layer split over torch.distributed.

    from exl.parallel import load_parallel
    model = load_parallel("model-dir", tp=2)   # use like exl.load_model(...)

See docs/parallel.md.
"""

from exl.parallel.context import register_context
from exl.parallel.launch import add_parallel_arguments, close_all, load_parallel, parse_gpu_split
from exl.parallel.model import ParallelModel
from exl.parallel.plan import ParallelError

__all__ = ["ParallelError", "ParallelModel", "add_parallel_arguments", "close_all", "load_parallel",
           "parse_gpu_split", "register_context"]
