"""Zero-copy loading: tensors the run takes as stored are views of the checkpoint file's mapping
(checked against the process's own memory map), the rest are copies; the file is never written."""
import hashlib
import mmap
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qlite.checkpoint import CheckpointDir
from qlite.loader import load_model
from qlite.memory import drop_pages
from qlite.qlinear import QuantLinear
from qlite.safetensors_io import SafetensorsWriter, TensorSpec
from quantize.convert import convert
from tiny_models import make_checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def file_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps from `path`."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def in_file(t: torch.Tensor, path: Path) -> bool:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(lo <= start and end <= hi for lo, hi in file_ranges(path))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("loader") / "ckpt", seed=3, hidden_size=128,
                           intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def int4(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("loader") / "int4"
    convert(src, out, bits=4, group_size=32, embed_bits=8, progress=False, report=False)
    return out


def test_quantized_tensors_are_views_of_the_file(int4):
    model = load_model(int4, dtype="bfloat16")
    stored = int4 / "model.safetensors"
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert {"qkv_proj", "gate_up_proj", "lm_head"} <= {n.rpartition(".")[2] for n, m in model.named_modules() if m in linears}
    for layer in linears:  # fused q/k/v and gate/up included: written back to back
        for t in layer.stored().values():
            assert in_file(t, stored)
    assert in_file(model.model.embed_tokens.qweight, stored)
    norm = model.model.norm.weight  # float32 in the file, bf16 in the run: a copy
    assert norm.dtype == torch.bfloat16 and not in_file(norm, stored)


def test_fused_parts_are_written_back_to_back(int4):
    ckpt = CheckpointDir(int4)
    for kind in ("qweight", "scales", "zeros"):
        names = [f"model.layers.1.self_attn.{p}_proj.{kind}" for p in "qkv"]
        assert ckpt.mapped(names) is not None
        assert torch.equal(ckpt.mapped(names), torch.cat([ckpt.read(n) for n in names]))
        assert ckpt.mapped(names[::-1]) is None  # apart, in that order
    assert ckpt.mapped([f"model.layers.0.mlp.{p}_proj.qweight" for p in ("gate", "up")]) is not None


def test_a_write_to_a_loaded_weight_leaves_the_file_alone(int4):
    digest = hashlib.sha256((int4 / "model.safetensors").read_bytes()).hexdigest()
    model = load_model(int4)
    qweight = model.model.layers[0].self_attn.qkv_proj.qweight
    before = qweight.clone()
    qweight.add_(1)  # private, copy-on-write pages: this process's copy only
    assert hashlib.sha256((int4 / "model.safetensors").read_bytes()).hexdigest() == digest
    assert torch.equal(load_model(int4).model.layers[0].self_attn.qkv_proj.qweight, before)


def test_a_16bit_checkpoint_maps_what_the_run_takes_as_stored(src, tmp_path):
    """bf16 stored, bf16 run: views, except a fused projection whose parts lie apart (q, k, v in
    name order are k, q, v); every tensor equals the file's."""
    out = tmp_path / "bf16"
    out.mkdir()
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    model = load_model(out, dtype="bfloat16")
    stored = out / "model.safetensors"
    layer = model.model.layers[0]
    assert in_file(layer.self_attn.o_proj.weight, stored) and in_file(model.model.embed_tokens.weight, stored)
    assert not in_file(layer.self_attn.qkv_proj.weight, stored)
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(
        [tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(layer.mlp.down_proj.weight, tensors["model.layers.0.mlp.down_proj.weight"])


def test_a_tensor_not_aligned_to_its_dtype_is_read_not_mapped(tmp_path):
    path = tmp_path / "model.safetensors"
    writer = SafetensorsWriter(path, [TensorSpec("a", torch.uint8, (3,)), TensorSpec("b", torch.float16, (4,))])
    writer.write("a", torch.arange(3, dtype=torch.uint8))
    writer.write("b", torch.arange(4, dtype=torch.float16))
    writer.close()
    ckpt = CheckpointDir(tmp_path)
    assert ckpt.mapped(["b"]) is None  # at an odd offset
    assert torch.equal(ckpt.read("b"), torch.arange(4, dtype=torch.float16))
    assert torch.equal(ckpt.mapped(["a"]), torch.arange(3, dtype=torch.uint8))


def smaps_rss_kib(path: Path) -> int:
    rss, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            ours = len(fields) == 6 and fields[5] == str(path.resolve())
        elif ours and fields[0] == "Rss:":
            rss += int(fields[1])
    return rss


def test_drop_pages_releases_whole_pages_only(tmp_path):
    path = tmp_path / "blob"
    page = mmap.PAGESIZE
    path.write_bytes(bytes(range(256)) * (64 * page // 256))
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=64 * page)
    data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (64 * page,))
    expected = data.clone()
    assert int(data.sum()) > 0  # every page read in
    resident = smaps_rss_kib(path)
    assert resident >= 64 * page // 1024
    drop_pages(data.data_ptr() + page // 2, 10 * page)  # whole pages inside: 9 of them
    assert resident - smaps_rss_kib(path) == 9 * page // 1024
    assert torch.equal(data, expected)  # read in again from the file


def test_int4_codes_copied_into_tiles_leave_the_mapping(tmp_path):
    """The integer-activation int4 kernel takes its own, tiled copy of the codes (native.tile_codes): the
    load drops the file's pages of them, so that they are not resident twice."""
    from qlite import native
    from qlite.kernels import VnniInt4
    if not native.vnni_ready():
        pytest.skip("no integer-activation kernels (AVX-512 without VNNI)")
    src = make_checkpoint(tmp_path / "src", seed=1, hidden_size=512, intermediate_size=1536,
                          num_attention_heads=8, num_key_value_heads=2)
    out = tmp_path / "int4"
    convert(src, out, bits=4, group_size=128, embed_bits=8, progress=False, report=False)
    model = load_model(out)
    tiled = [m for m in model.modules() if isinstance(m, QuantLinear) and isinstance(m.kernel, VnniInt4)]
    assert tiled
    page, stored = mmap.PAGESIZE, out / "model.safetensors"
    whole_pages = sum((m.qweight.data_ptr() + m.qweight.numel()) // page - -(-m.qweight.data_ptr() // page)
                      for m in tiled)
    assert whole_pages > 50
    assert smaps_rss_kib(stored) * 1024 <= stored.stat().st_size - whole_pages * page
    for m in tiled:
        assert torch.equal(m.kernel.stored["qweight"], native.tile_codes(m.qweight))  # read in again: the same codes
