"""Load a checkpoint dir into qlite's Qwen2: build on the meta device (quantized modules where the
config says so, projections fused), check every checkpoint name and shape from the headers, assign
tensors read one at a time through safetensors (no pickles), then pick the backend once."""
from __future__ import annotations

from pathlib import Path

import torch

from . import kv_quant, native
from .backends import backend_named, use_backend
from .checkpoint import DTYPE_NAMES, FLOAT_DTYPES, FLOAT_STORAGE, CheckpointDir
from .errors import QliteError
from .formats import stored_problem
from .memory import large_allocations_from_mmap, release_freed_memory
from .decoder.causal_lm import CausalLM
from .decoder.layers import DecoderLayer
from .decoder.linear import Linear
from .decoder.names import SHARED_BY_PARTS, checkpoint_layout, checkpoint_shapes
from .system import cpu_has_bf16



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
    """auto: bf16 on a CPU with native bf16 or qlite's native kernels (which take bf16 activations: on an
    AVX2 CPU they decode faster than with float32 ones), else float32; bf16 or fp16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() or native.library() is not None else torch.float32
    if dtype not in FLOAT_DTYPES:
        raise QliteError(f"--dtype {dtype}: choose auto, float32, bfloat16 or float16")
    return FLOAT_DTYPES[dtype]


def check_dtypes(ckpt: CheckpointDir, layout: dict[str, list[tuple[str, tuple]]], stored: dict[str, torch.dtype]) -> None:
    """Every checkpoint tensor in the dtype the model expects: a quantized format's tensors exactly as
    the format stores them (`stored`, by model key), everything else a float type. A kernel never
    sees a buffer of another dtype (it would read past its end)."""
    for key, parts in layout.items():
        want = stored.get(key)
        for name, _ in parts:
            info = ckpt.tensors[name]
            ok = info.torch_dtype == want if want is not None else info.dtype in FLOAT_STORAGE
            if not ok:
                raise QliteError(f"{info.file}: tensor {name} is stored as {info.dtype}, "
                                 f"expected {DTYPE_NAMES[want] if want else 'a float type'}")


def read_state(ckpt: CheckpointDir, layout: dict[str, list[tuple[str, tuple]]], convert) -> dict[str, torch.Tensor]:
    """The model's state dict from the checkpoint: `layout` (decoder.names.checkpoint_layout) says which
    checkpoint tensors make each model tensor, row blocks in order (names, shapes and dtypes checked
    already). A tensor the run takes as stored (`convert(model key, tensor)` returns it unchanged),
    its parts back to back in the file, is a view of the file's mapping: nothing copied. Any other
    is converted or concatenated, and its pages in the mapping dropped."""
    def stored(name):  # a view of the mapping, or (not element-aligned) a copy read through safetensors
        view = ckpt.mapped([name])
        return ckpt.read(name).clone() if view is None else view

    state: dict[str, torch.Tensor] = {}
    for key, parts in layout.items():
        names = [name for name, _ in parts]
        if key.rpartition(".")[2] in SHARED_BY_PARTS:  # every part holds it whole: they must agree
            for name in names[1:]:
                if not torch.equal(stored(name), stored(names[0])):
                    raise QliteError(f"{ckpt.tensors[name].file}: tensor {name} differs from {names[0]}; the "
                                     f"projections qlite fuses need one {key.rpartition('.')[2]}")
            names = names[:1]
        whole = ckpt.mapped(names)
        if whole is not None:
            state[key] = convert(key, whole)
        elif len(names) == 1:
            state[key] = convert(key, stored(names[0]))
        else:  # parts apart in the file: one copy
            state[key] = torch.cat([convert(key, stored(name)) for name in names])
        if state[key] is not whole:
            ckpt.release(names)
    return state


def check_stored_values(model, ckpt: CheckpointDir) -> None:
    """Values the dtypes and shapes allow but the format does not (an int4 zero point past 15, an
    input_order that is no permutation of the columns): an error naming the layer, before any kernel,
    gather or export reads them."""
    for name, mod in model.named_modules():
        if not hasattr(mod, "fmt") or not hasattr(mod, "stored"):
            continue
        problem = stored_problem(mod.fmt, mod.stored(), getattr(mod, "input_order", None))
        if problem is not None:
            raise QliteError(f"{ckpt.path}: {name}: {problem}")


def float_layer(ckpt: CheckpointDir, cfg, i: int, experts_as_stored: bool = False) -> DecoderLayer:
    """Decoder layer i of a 16-bit checkpoint alone, in float32 (cfg: the config without quantization):
    GPTQ's calibration and the quantization report run the source one layer at a time.
    experts_as_stored: a mixture's experts keep the stored dtype, each product widening its expert alone
    (for passes that only read the weights: a float32 layer of Qwen3-30B-A3B's 128 experts is 2.4 GB)."""
    with torch.device("meta"):
        layer = DecoderLayer(cfg, i)  # shapes only: each tensor is then made once, in float32 (or as stored)
    state = {}
    for key, parts in checkpoint_layout(layer).items():
        stored = [ckpt.read(f"model.layers.{i}.{name}") for name, _ in parts]
        dtype = stored[0].dtype if experts_as_stored and ".experts." in key else torch.float32
        state[key] = whole = torch.empty(sum(t.shape[0] for t in stored), *stored[0].shape[1:], dtype=dtype)
        row = 0  # parts' rows stacked
        for t in stored:  # widened straight into place: no float32 copy of a part besides
            whole[row:row + t.shape[0]].copy_(t)
            row += t.shape[0]
    layer.load_state_dict(state, assign=True)
    for linear in layer.modules():  # the experts kept as stored (no bias)
        if isinstance(linear, Linear) and linear.weight.dtype != torch.float32:
            linear.kernel = lambda x, w=linear.weight: _Widened.apply(x, w)
    return layer


class _Widened(torch.autograd.Function):
    """x @ w.T for a float32 x and a 16-bit w [N, K], widened for the product alone: backward keeps w,
    not a float32 copy (F.linear would keep every expert's widened copy until the backward pass)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w)
        return x @ w.float().T

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (w,) = ctx.saved_tensors
        return g @ w.float(), None


def check_kv_cache(kv_cache: str, cfg, model_dir: Path) -> None:
    """--kv-cache KIND for a model of this config: a kind kv_quant knows, whose groups divide head_dim."""
    if kv_cache not in kv_quant.KINDS:
        raise QliteError(f"--kv-cache {kv_cache!r}: one of {', '.join(kv_quant.KINDS)}")
    if kv_quant.KINDS[kv_cache] != 16 and cfg.head_dim % kv_quant.GROUP:
        raise QliteError(f"--kv-cache {kv_cache}: {Path(model_dir) / 'config.json'}: head_dim {cfg.head_dim} is not a "
                         f"multiple of {kv_quant.GROUP} (the quantized cache's group)")


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
               kernel: str = "auto", kv_cache: str = "bf16") -> CausalLM:
    """Load a (possibly quantized) checkpoint dir. Floating parameters are cast to `dtype`; quantized
    buffers keep their stored dtype. `kernel` names the backend (backends.py); `kv_cache` what the
    caches it makes hold (kv_quant.KINDS)."""
    backend_named(kernel)  # an unknown name fails before anything is read
    ckpt = CheckpointDir(model_dir)
    cfg = ckpt.config
    check_kv_cache(kv_cache, cfg, ckpt.path)
    dev = resolve_device(device)
    large_allocations_from_mmap()
    model = checked_model(ckpt, resolve_dtype(dtype, dev), dev)
    model.model.rotary.to(dev)
    use_backend(model, kernel, release=ckpt.release_view)
    model.kv_bits = kv_quant.KINDS[kv_cache]
    release_freed_memory()
    return model.eval()


def check_loads(model_dir: Path, out: Path) -> None:
    """Everything load_model checks, on the tensors as stored (mapped, nothing converted): what
    quantize and import run on the finished temporary dir before it becomes `out`, so a file the
    runtime refuses is never written with success."""
    try:
        checked_model(CheckpointDir(model_dir), None, torch.device("cpu"))
    except QliteError as e:
        raise QliteError(f"{out}: not written, the runtime would refuse it: {str(e).replace(str(model_dir), str(out))}") from None


def checked_model(ckpt: CheckpointDir, float_dtype: torch.dtype | None, dev: torch.device) -> CausalLM:
    """The checkpoint's model with every tensor in place (mapped where the run takes it as stored;
    float_dtype None: floats as stored too), names, shapes, dtypes and stored values checked, a tied
    head sharing the loaded table; no backend picked yet."""
    try:
        with torch.device("meta"):
            model = CausalLM(ckpt.config)
    except QliteError as e:  # a format that cannot hold a layer (a group size that does not divide, ...)
        raise QliteError(f"{ckpt.path / 'config.json'}: quantization_config: {e}") from None
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}

    def convert(key, t):  # parameters take the run dtype; quantized buffers keep their stored one
        return t.to(device=dev, dtype=float_dtype if key in params and float_dtype is not None else t.dtype)

    layout = checkpoint_layout(model)
    ckpt.check_tensors(checkpoint_shapes(layout))
    check_dtypes(ckpt, layout, {k: t.dtype for k, t in model.state_dict(keep_vars=True).items() if k not in params})
    model.load_state_dict(read_state(ckpt, layout, convert), assign=True, strict=False)
    model.tie_weights()  # assign replaced the table's tensors: a tied head takes the loaded ones before any check
    check_stored_values(model, ckpt)
    return model
