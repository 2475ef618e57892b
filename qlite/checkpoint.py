"""A checkpoint directory as qlite reads it: config.json, safetensors shards and their index, side
files such as the tokenizer. Safetensors only: no pickle is ever loaded. (Writing: outputs.py.)"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import Qwen2Config, read_json
from .errors import QliteError

INDEX_NAME = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # the safetensors name: F16, U8, ...
    shape: tuple[int, ...]

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

    @functools.cached_property
    def config_dict(self) -> dict:
        return read_json(self.path / "config.json")

    @functools.cached_property
    def config(self) -> Qwen2Config:
        """The config, checked against what the files hold before anything is sized from it."""
        source = self.path / "config.json"
        cfg = Qwen2Config.from_dict(self.config_dict, source=str(source))
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
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise QliteError(f"{index}: no weight_map")
            files = sorted(set(weight_map.values()))
            for f in files:  # plain file names of regular files in this dir: no paths, links out, FIFOs
                if not isinstance(f, str) or Path(f).name != f or f in (".", ".."):
                    raise QliteError(f"{index}: {f!r} is not a file name in the checkpoint dir")
                if not (self.path / f).exists():
                    raise QliteError(f"{self.path / f}: named by {INDEX_NAME} but missing")
                if not (self.path / f).is_file() or not _inside(self.path / f, self.path):
                    raise QliteError(f"{self.path / f}: named by {INDEX_NAME} but not a regular file in {self.path}")
            return [self.path / f for f in files]
        single = self.path / "model.safetensors"
        if single.exists():
            if not single.is_file() or not _inside(single, self.path):
                raise QliteError(f"{single}: not a regular file in {self.path}")
            return [single]
        if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
            raise QliteError(f"{self.path}: only pickle weights (.bin/.pt) found; qlite loads safetensors only")
        raise QliteError(f"{self.path}: no model.safetensors or {INDEX_NAME}")

    @functools.cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor by name, in file order, from the headers alone."""
        from safetensors import SafetensorError, safe_open

        out = {}
        for path in self.files():
            try:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        out[name] = TensorInfo(path, sl.get_dtype(), tuple(sl.get_shape()))
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

        if name not in self.tensors:
            raise QliteError(f"{self.path}: missing tensor {name}")
        info = self.tensors[name]
        with safe_open(info.file, framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t)  # NaN propagates; one fast pass
            if not (torch.isfinite(lo) and torch.isfinite(hi)):
                raise QliteError(f"{info.file}: tensor {name} holds NaN or infinite values")
        return t

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
        """The regular files other than config and weights (tokenizer, generation config, chat
        template, ...); a link is followed only while it stays inside the checkpoint dir."""
        files = [f for f in sorted(self.path.iterdir()) if f.is_file() and f.name not in ("config.json", INDEX_NAME)
                 and not f.name.endswith(WEIGHT_SUFFIXES)]
        for f in files:
            if not _inside(f, self.path):
                raise QliteError(f"{f}: links to {f.resolve()}, outside the checkpoint dir; refusing to read it")
        return files


def _inside(path: Path, directory: Path) -> bool:
    """Whether path, links resolved, lies inside directory, or in the blobs dir of a Hugging Face
    cache snapshot (SNAPSHOT/../../blobs, where the hub's own links point)."""
    target = path.resolve().parents
    return directory.resolve() in target or (directory / ".." / ".." / "blobs").resolve() in target
