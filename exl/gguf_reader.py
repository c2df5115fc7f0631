"""A small, fast reader for GGUF files (llama.cpp's model format): metadata and raw tensor bytes.

    gguf_file = read_gguf("model.gguf")
    gguf_file.metadata["general.architecture"]         # plain Python values; arrays as lists
    t = gguf_file.tensors["blk.0.attn_q.weight"]
    t.shape, t.type.name, t.data                       # data: uint8 rows (one per row of the tensor), memory-mapped

`gguf.GGUFReader` builds a numpy view per array element, which takes seconds for a 50k-token
vocabulary; this parser reads the header with `struct` and maps tensor data lazily. Damaged files
raise ModelLoadError naming the file and what is wrong.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exl.errors import ModelLoadError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # PyTorch order (outermost first); GGUF stores dimensions innermost first
    type: "gguf.GGMLQuantizationType"  # noqa: F821
    data: np.ndarray  # uint8, shape (rows, bytes per row)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    def dequantize(self) -> np.ndarray:
        """The tensor as float32 in `shape`, via `gguf.quants.dequantize` (every type it supports)."""
        import gguf

        return np.asarray(gguf.quants.dequantize(self.data, self.type), dtype=np.float32).reshape(self.shape)


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, path: Path, buf: memoryview):
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(f"{self.path} is truncated: the header ends early (at byte {len(self.buf)}) -- download it again")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path} is truncated: the header ends early (at byte {len(self.buf)}) -- download it again")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALARS and item != 7:
                dtype = np.dtype(_SCALARS[item])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ModelLoadError(f"{self.path} is truncated: the header ends early -- download it again")
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return values
            return [self.value(item) for _ in range(count)]
        raise ModelLoadError(f"{self.path} is corrupt: unknown metadata value type {kind} at byte {self.pos}")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors (no tensor data is read until used)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, expected b'GGUF')")
    size = path.stat().st_size
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(path, memoryview(mm))
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        kind, offset = cur.take("<I"), cur.take("<Q")
        try:
            kind = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown type {kind}; the file is corrupt or too new") from None
        infos.append((name, dims, kind, offset))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment

    tensors = {}
    for name, dims, kind, offset in infos:
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        inner = dims[0] if dims else 1
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        if inner % block:
            raise ModelLoadError(f"{path}: tensor {name!r} row length {inner} is not a multiple of {kind.name}'s block size {block}")
        row_bytes = inner // block * type_size
        begin, end = start + offset, start + offset + rows * row_bytes
        if end > size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {name!r} needs bytes up to {end}, the file has {size} -- download it again"
            )
        tensors[name] = GGUFTensor(name, tuple(reversed(dims)), kind, mm[begin:end].reshape(rows, row_bytes))
    return GGUFFile(path, version, metadata, tensors)
