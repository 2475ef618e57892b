"""A checkpoint directory as qlite reads it: config.json, safetensors shards and their index, side
files such as the tokenizer. Safetensors only: no pickle is ever loaded. (Writing: outputs.py.)"""
from __future__ import annotations

import functools
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import QliteError
from .files import inside, open_regular, read_json
from .memory import drop_pages

INDEX_NAME = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
FLOAT_STORAGE = tuple(name for name, dtype in SAFETENSORS_DTYPES.items() if dtype.is_floating_point)  # F64 .. BF16
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # the safetensors name: F16, U8, ...
    shape: tuple[int, ...]
    offset: int = 0  # where its bytes start in the file

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return SAFETENSORS_DTYPES.get(self.dtype)

    @property
    def nbytes(self) -> int:
        size = torch.empty((), dtype=self.torch_dtype).element_size() if self.torch_dtype else 1
        return math.prod(self.shape) * size


class CheckpointDir:
    """config.json, tensor headers (names, dtypes, shapes) and single tensors of a checkpoint dir."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise QliteError(f"{self.path}: not a directory")
        self._mappings: dict[Path, torch.UntypedStorage] = {}  # mapped(): one mapping per file, made when first used

    @functools.cached_property
    def config_dict(self) -> dict:
        return read_json(self.path / "config.json", within=self.path)

    @functools.cached_property
    def config(self) -> ModelConfig:
        """The config, checked against what the files hold before anything is sized from it."""
        source = self.path / "config.json"
        cfg = ModelConfig.from_dict(self.config_dict, source=str(source))
        layers = {int(m[1]) for m in map(LAYER_NAME.match, self.tensors) if m}
        if len(layers) != cfg.num_hidden_layers or layers and max(layers) != len(layers) - 1:  # 0..n-1
            raise QliteError(f"{source}: num_hidden_layers is {cfg.num_hidden_layers}, the tensors hold "
                             f"{len(layers)} layers")
        embed = self.tensors.get("model.embed_tokens.weight")
        if embed is not None and embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise QliteError(f"{source}: vocab_size x hidden_size is {cfg.vocab_size} x {cfg.hidden_size}, "
                             f"model.embed_tokens.weight is {' x '.join(map(str, embed.shape))}")
        return cfg

    def files(self) -> list[Path]:
        """The safetensors files: those the index names, or model.safetensors."""
        index = self.path / INDEX_NAME
        if index.exists():
            weight_map = read_json(index, within=self.path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise QliteError(f"{index}: no weight_map")
            bad = [f for f in weight_map.values() if not isinstance(f, str)]
            if bad:  # before the set and the sort: a list is unhashable, an int or null unsortable with names
                raise QliteError(f"{index}: weight_map value {bad[0]!r} is not a file name"[:300])
            files = sorted(set(weight_map.values()))
            for f in files:  # plain file names of regular files in this dir: no paths, links out, FIFOs
                if Path(f).name != f or f in (".", ".."):
                    raise QliteError(f"{index}: {f!r} is not a file name in the checkpoint dir")
                if not (self.path / f).exists():
                    raise QliteError(f"{self.path / f}: named by {INDEX_NAME} but missing")
                if not (self.path / f).is_file() or not inside(self.path / f, self.path):
                    raise QliteError(f"{self.path / f}: named by {INDEX_NAME} but not a regular file in {self.path}")
            return [self.path / f for f in files]
        single = self.path / "model.safetensors"
        if single.exists():
            if not single.is_file() or not inside(single, self.path):
                raise QliteError(f"{single}: not a regular file in {self.path}")
            return [single]
        if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
            raise QliteError(f"{self.path}: only pickle weights (.bin/.pt) found; qlite loads safetensors only")
        raise QliteError(f"{self.path}: no model.safetensors or {INDEX_NAME}")

    @functools.cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor by name, in file order, from the headers alone (checked by safetensors:
        offsets inside the file, no overlaps; the offsets themselves read from the same header)."""
        from safetensors import SafetensorError, safe_open

        out = {}
        for path in self.files():
            try:
                with safe_open(path, framework="pt") as f:
                    spans = _data_spans(path)
                    for name in f.keys():
                        sl = f.get_slice(name)
                        out[name] = TensorInfo(path, sl.get_dtype(), tuple(sl.get_shape()), spans[name][0])
                        if spans[name][1] - spans[name][0] != out[name].nbytes:  # e.g. a name given twice
                            raise QliteError(f"{path}: tensor {name}: its header entries disagree")
            except SafetensorError as e:
                raise QliteError(f"{path}: unreadable safetensors file ({e})") from None
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, name: str) -> torch.Tensor:
        """One tensor, read through its own mapping of the file (dropped with it: the pages read do
        not stay resident once the tensor is converted or copied); a float tensor must be finite."""
        from safetensors import safe_open

        info = self._info(name)
        with safe_open(info.file, framework="pt", device="cpu") as f:
            return _finite(f.get_tensor(name), info, name)

    def mapped(self, names: list[str]) -> torch.Tensor | None:
        """The tensors `names`, rows concatenated, as one view of the file's mapping when they lie
        back to back in one file with one dtype and row shape (else None). One private,
        copy-on-write mapping per file, kept alive by its views: nothing is copied, the page cache
        is shared with every other process reading the file, and the file is never written. Float
        data must be finite."""
        infos = [self._info(n) for n in names]
        first = infos[0]
        for prev, info in zip(infos, infos[1:]):
            if (info.file, info.dtype, info.shape[1:]) != (prev.file, prev.dtype, prev.shape[1:]) \
                    or not info.shape or info.offset != prev.offset + prev.nbytes:
                return None
        size = torch.empty((), dtype=first.torch_dtype).element_size()
        if first.offset % size:  # not element-aligned: only a copy can hold it
            return None
        shape = (sum(i.shape[0] for i in infos), *first.shape[1:]) if len(infos) > 1 else first.shape
        view = torch.empty(0, dtype=first.torch_dtype).set_(self._mapping(first.file), first.offset // size, shape)
        return _finite(view, first, names[0])

    def release(self, names: list[str]) -> None:
        """Drop the pages of tensors `names` (read and converted, never used as they are) from this
        process's mappings, so that they do not stay resident with the views that are used."""
        for name in names:
            info = self.tensors[name]
            if info.file in self._mappings:
                drop_pages(self._mappings[info.file].data_ptr() + info.offset, info.nbytes)

    def release_view(self, t: torch.Tensor) -> None:
        """Drop the pages of t from this process if it is a view of one of the files' mappings (a kernel
        keeps a copy of it in another layout); anything else is left alone."""
        nbytes = t.numel() * t.element_size()
        for mapping in self._mappings.values():
            if mapping.data_ptr() <= t.data_ptr() and t.data_ptr() + nbytes <= mapping.data_ptr() + mapping.nbytes():
                drop_pages(t.data_ptr(), nbytes)

    def _mapping(self, path: Path) -> torch.UntypedStorage:
        if path not in self._mappings:
            self._mappings[path] = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=path.stat().st_size)
        return self._mappings[path]

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise QliteError(f"{self.path}: missing tensor {name}")
        return self.tensors[name]

    def check_tensors(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every expected name present with its shape, and nothing else."""
        for name, info in self.tensors.items():
            if name not in expected:
                raise QliteError(f"{info.file}: unexpected tensor {name}")
            if info.shape != tuple(expected[name]):
                raise QliteError(f"{info.file}: tensor {name} has shape {info.shape}, "
                                 f"the config implies {tuple(expected[name])}")
        missing = [name for name in expected if name not in self.tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise QliteError(f"{self.path}: missing tensor {missing[0]}{more}")

    def side_files(self) -> list[Path]:
        """The files other than config and weights (tokenizer, generation config, chat template, ...),
        copied as they are: each a regular file inside the checkpoint dir, links resolved (a FIFO,
        device or link out is an error, not a file silently left behind). Subdirs are not copied."""
        files = []
        for f in sorted(self.path.iterdir()):
            if f.name in ("config.json", INDEX_NAME) or f.name.endswith(WEIGHT_SUFFIXES):
                continue
            if (f.is_symlink() or f.exists()) and not inside(f, self.path):
                raise QliteError(f"{f}: links to {f.resolve()}, outside the checkpoint dir; refusing to read it")
            if f.is_dir():
                continue
            open_regular(f, within=self.path).close()  # a FIFO or device: an error naming it
            files.append(f)
        return files


def _data_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's bytes [start, end) in a safetensors file (whose header safetensors has checked):
    8 bytes of header length, the JSON header, then the data at each tensor's data_offsets."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {name: (8 + n + entry["data_offsets"][0], 8 + n + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


def _finite(t: torch.Tensor, info: TensorInfo, name: str) -> torch.Tensor:
    if t.is_floating_point() and t.numel():
        lo, hi = torch.aminmax(t)  # NaN propagates; one fast pass
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            raise QliteError(f"{info.file}: tensor {name} holds NaN or infinite values")
    return t

