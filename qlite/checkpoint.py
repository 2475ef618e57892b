"""Load a checkpoint dir into qlite's Qwen2: build on the meta device, swap in quantized modules if
the config says so, then assign tensors read one at a time through safetensors (no pickles)."""
from __future__ import annotations

from pathlib import Path

import torch

from .config import load_config
from .errors import QliteError
from .model import Qwen2ForCausalLM
from .safetensors_io import tensor_index

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise QliteError(f"--device {device}: not a device name (cpu, cuda, cuda:1, auto)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QliteError(f"--device {device}: no CUDA device available")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """auto: bf16 on a CPU with native bf16 (else float32); bf16 or fp16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if dtype not in DTYPES:
        raise QliteError(f"--dtype {dtype}: choose auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def read_tensors(model_dir: Path, expected: dict[str, torch.Size], convert):
    """Yield (name, converted tensor) for every tensor in the checkpoint. Names and shapes are all
    checked from the headers before any data is read. Each tensor is read through its own mapping
    of the file, dropped with it: the pages read for a converted tensor do not stay resident."""
    from safetensors import safe_open

    index = tensor_index(model_dir)
    for path, name, _, shape in index:
        if name not in expected:
            raise QliteError(f"{path}: unexpected tensor {name}")
        if shape != tuple(expected[name]):
            raise QliteError(f"{path}: tensor {name} has shape {shape}, the config implies {tuple(expected[name])}")
    missing = sorted(set(expected) - {name for _, name, _, _ in index})
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise QliteError(f"{model_dir}: missing tensor {missing[0]}{more}")
    for path, name, _, _ in index:
        with safe_open(path, framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        yield name, convert(name, t)


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
               kernel: str = "auto", fuse: bool = True) -> Qwen2ForCausalLM:
    """Load a (possibly quantized) checkpoint dir. Floating tensors are cast to `dtype`; quantized
    buffers keep theirs and are repacked once for the chosen kernel. fuse: q/k/v and gate/up become
    one matmul each (exact; the module names then differ from the checkpoint's)."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    dev = resolve_device(device)
    large_allocations_from_mmap()
    float_dtype = resolve_dtype(dtype, dev)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    quantized = cfg.quantization_config is not None
    if quantized:
        from .qlinear import swap_quantized_modules
        swap_quantized_modules(model, cfg.quantization_config, source=str(model_dir / "config.json"))
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear):  # shared with the embedding
        expected.pop("lm_head.weight", None)

    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}

    def convert(name, t):
        # Parameters take the run dtype; quantized buffers keep their stored one. A tensor that needs
        # no conversion is copied out of the file mapping anyway: an mmap-backed tensor would keep
        # the whole file mapped, and the pages read for converted tensors resident with it.
        out = t.to(device=dev, dtype=float_dtype if name in params else t.dtype)
        return out.clone() if out is t else out

    state = dict(read_tensors(model_dir, expected, convert))
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    model.model.rotary.to(dev)
    if fuse:
        from .fuse import fuse_projections
        fuse_projections(model)
    if quantized:
        from .qlinear import prepare_for_kernel
        prepare_for_kernel(model, kernel=kernel, dtype=float_dtype)
    if kernel in ("auto", "native"):
        from .kernels import use_native_dense
        use_native_dense(model)
    release_freed_memory()
    return model.eval()


def large_allocations_from_mmap() -> None:
    """Make glibc serve every allocation over 1 MiB with its own mapping, returned to the OS when
    freed. By default glibc raises that threshold after the first large free, and loading's
    conversion temporaries then fragment the heap into resident memory that is never used again."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def release_freed_memory() -> None:
    """Hand the heap that loading freed (conversion and repacking temporaries) back to the OS;
    glibc keeps it otherwise, and it would show as resident memory for the life of the process."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
