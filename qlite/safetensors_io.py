"""Streaming safetensors output.

The `safetensors` package writes a file from a dict held wholly in memory; qlite writes one tensor
at a time instead (the header needs only names, dtypes and shapes, known up front), so converting a
model never holds more than one tensor. Reading is left to `safetensors.safe_open`.
Format: 8-byte little-endian header length, JSON header, then the raw tensor bytes in order.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import DTYPE_NAMES, INDEX_NAME


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class SafetensorsWriter:
    """Writes the tensors of `specs`, in that order, to one safetensors file, one call at a time."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for s in specs:
            header[s.name] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape),
                              "data_offsets": [offset, offset + s.nbytes]}
            offset += s.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        self._specs = iter(specs)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = next(self._specs, None)
        if spec is None or spec.name != name or spec.dtype != tensor.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} does not match the plan {spec}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))

    def close(self) -> None:
        left = next(self._specs, None)
        self._file.close()
        if left is not None:
            raise ValueError(f"tensor {left.name} was planned but never written")


def made_in_order(specs: list[TensorSpec], made_by: dict, make, progress=None):
    """(name, tensor) for each of `specs` in order, for write_sharded: `made_by[name]` is the job
    that makes a tensor and `make(job)` all of that job's tensors by name. A job is made when its
    first tensor is due; its others wait until theirs are (so tensors of several jobs can be
    interleaved in the file). progress(): called once per job made."""
    made: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.name not in made:
            made.update(make(made_by[spec.name]))
            if progress is not None:
                progress()
        yield spec.name, made.pop(spec.name)


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def shard_file_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_sharded(out_dir: Path, specs: list[TensorSpec], tensors, max_shard_bytes: int = 2 << 30,
                  metadata: dict[str, str] | None = None, progress=None) -> list[str]:
    """Write `tensors` (an iterable of (name, tensor) in the order of `specs`) as one or more shards
    and, if more than one, the index. Returns the file names written."""
    shards = plan_shards(specs, max_shard_bytes)
    names = shard_file_names(len(shards))
    it = iter(tensors)
    try:
        for shard, fname in zip(shards, names):
            writer = SafetensorsWriter(out_dir / fname, shard, metadata)
            for _ in shard:
                name, t = next(it)
                writer.write(name, t)
                if progress is not None:
                    progress(name)
            writer.close()
    finally:  # a generator's own cleanup (its progress bar) runs now, even on an error, not when it is collected
        getattr(it, "close", lambda: None)()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: fname for shard, fname in zip(shards, names) for s in shard}}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return names


def write_checkpoint_dir(out: Path, specs: list[TensorSpec], tensors, config: dict, *, inputs=(), force: bool = False,
                         flag: str = "--out", side_files=(), files: dict[str, str] | None = None,
                         max_shard_bytes: int = 2 << 30, finish=None):
    """The one writer of checkpoint dirs (quantize, export, import, import-gguf): `tensors` in the order
    of `specs` as shards, side files copied as regular files, `files` (name -> text) and config.json,
    all in a temporary dir that replaces `out` only when complete (outputs.atomic_output_dir). finish(tmp):
    called last, inside; its result is returned."""
    import shutil

    from .outputs import atomic_output_dir

    with atomic_output_dir(out, force=force, inputs=inputs, flag=flag) as tmp:
        write_sharded(tmp, specs, tensors, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"})
        for f in side_files:
            shutil.copyfile(Path(f).resolve(), tmp / Path(f).name)  # the bytes, as a regular file
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        return finish(tmp) if finish is not None else None
