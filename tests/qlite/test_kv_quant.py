"""The quantized KV cache (kv_quant.py, decoder.kv_cache.KVCache): its records byte for byte against a plain
Python reading of the documented layout, the error of a round trip, the key offsets against their
definition, and a model decoding through an int8 / int4 cache against the bf16 cache's logits."""
import math

import numpy as np
import pytest
import torch

from qlite import kv_quant
from qlite.decode import generate_tokens
from qlite.generate import SamplingParams
from qlite.loader import load_model
from tiny_models import make_checkpoint


def documented_record(values: list[float], bits: int) -> bytes:
    """The layout as kv_quant's docstring states it, one value at a time."""
    qmax = 127 if bits == 8 else 7
    codes, scales = [], []
    for g in range(0, len(values), 32):
        group = values[g:g + 32]
        scale = np.float16(min(max(abs(v) for v in group) / np.float32(qmax), 65504))
        s = float(scale)
        codes.append([0 if s == 0 else int(max(-qmax, min(qmax, round(np.float32(v) / np.float32(s))))) for v in group])
        scales.append(scale.tobytes())
    if bits == 8:
        body = bytes((c & 0xFF) for group in codes for c in group)
    else:
        body = bytes(((group[j] + 8) | ((group[j + 16] + 8) << 4)) for group in codes for j in range(16))
    return body + b"".join(scales)


@pytest.mark.parametrize("bits", [8, 4])
def test_records_are_the_documented_bytes(bits):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(bits)) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    x[1, 32:] = 0  # an all-zero group: scale 0, codes 0
    x[2, 5] = 1e6  # a scale fp16 cannot hold: clamped to 65504, codes clamped to the range
    records = kv_quant.encode(x.bfloat16(), bits)
    assert records.shape == (3, kv_quant.record_bytes(bits, 64)) == (3, {8: 68, 4: 36}[bits])
    for row in range(3):
        assert bytes(records[row].tolist()) == documented_record(x[row].bfloat16().float().tolist(), bits), row


@pytest.mark.parametrize("bits, sqnr_db", [(8, 38.0), (4, 14.0)])
def test_a_round_trip_is_within_half_a_step(bits, sqnr_db):
    x = torch.randn(8, 4, 128, generator=torch.Generator().manual_seed(0)) * 3  # (..., head_dim)
    back = kv_quant.decode(kv_quant.encode(x, bits), bits, 128, torch.float32)
    step = x.unflatten(-1, (4, 32)).abs().amax(-1, keepdim=True) / (127 if bits == 8 else 7)  # (..., 4, 1)
    assert ((back - x).unflatten(-1, (4, 32)).abs() <= step / 2 * 1.002 + 1e-6).all()
    assert 10 * math.log10(x.pow(2).sum() / (back - x).pow(2).sum()) > sqnr_db


def test_key_offsets_are_the_mean_rotated_key_bias(tmp_path):
    """Each pair (i, i + hd/2) of the k bias turned by position x frequency i, averaged over 4096
    positions: computed here with complex numbers."""
    model = load_model(make_checkpoint(tmp_path / "ckpt", hidden_size=128), dtype="float32", kv_cache="int8")
    attn, layer = model.model.layers[1].self_attn, 1
    hd, half = attn.head_dim, attn.head_dim // 2
    bias = attn.key_bias().view(attn.n_kv, hd).double()
    freqs = 1.0 / model.config.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / hd)
    turns = torch.exp(1j * torch.arange(4096, dtype=torch.float64)[:, None] * freqs).mean(0)  # (half,)
    rotated = torch.complex(bias[:, :half], bias[:, half:]) * turns  # (n_kv, half)
    want = torch.cat([rotated.real, rotated.imag], dim=-1)
    assert torch.allclose(model.key_offsets()[layer].double(), want, atol=1e-5)
    assert model.new_cache(1, 4).k_offset is model.key_offsets()
    assert load_model(tmp_path / "ckpt", dtype="float32").new_cache(1, 4).k_offset is None  # bf16: no offsets


def kl(base: torch.Tensor, other: torch.Tensor) -> float:
    p = torch.log_softmax(base.float(), -1)
    return (p.exp() * (p - torch.log_softmax(other.float(), -1))).sum(-1).mean().item()


def test_a_quantized_cache_decodes_close_to_the_bf16_one_and_its_offsets_matter(tmp_path):
    """Logits of a prompt prefilled in chunks then decoded token by token through an int8 / int4 cache:
    close to the bf16 cache's, int8 closer than int4, both further off without the key offsets on a model
    whose k biases are large in the slowly turning channels (as Qwen2's are, rope theta 1e6)."""
    path = make_checkpoint(tmp_path / "ckpt", hidden_size=128, rope_theta=1e6)  # head_dim 32
    ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(5))

    def logits(kv_cache, offsets=True):
        model = load_model(path, dtype="float32", kv_cache=kv_cache)
        for layer in model.model.layers:
            attn = layer.self_attn
            bias = attn.key_bias().data.view(attn.n_kv, 2, attn.head_dim // 2)  # (n_kv, halves, pairs)
            bias[:, :, -2:] = 40.0  # the two slowest pairs: nearly the same in every key
        if not offsets:
            model._key_offsets = None
        model.prefill_chunk = 16
        cache = model.new_cache(1, 40)
        with torch.no_grad():
            return torch.cat([model(ids[:, :32], cache)] + [model(ids[:, t:t + 1], cache) for t in range(32, 40)], 1)

    base = logits("bf16")
    kl8, kl4 = kl(base, logits("int8")), kl(base, logits("int4"))
    assert 0 < kl8 < 1e-3 and kl8 < kl4 < 0.1  # measured 3e-5, 0.013
    assert kl(base, logits("int8", offsets=False)) > 10 * kl8  # 0.004: 140x
    assert kl(base, logits("int4", offsets=False)) > 10 * kl4  # 0.28: 22x


def test_generation_batching_and_refusals_with_a_quantized_cache(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", hidden_size=128)  # head_dim 32
    model = load_model(path, dtype="float32", kv_cache="int8")
    prompts = [[7, 8, 9, 10, 11, 12, 13], [300, 301], [42, 43, 44, 45]]
    params = SamplingParams(max_new_tokens=10)
    batch = torch.stack(list(generate_tokens(model, prompts, params, eos_ids=(), pad_id=0)), dim=1)
    for row, p in enumerate(prompts):  # a row's numbers are its own, padded or alone
        assert batch[row].tolist() == [int(t[0]) for t in generate_tokens(model, [p], params, eos_ids=())]
    from qlite.errors import QliteError
    with pytest.raises(QliteError, match="--kv-cache 'int2': one of bf16, int8, int4"):
        load_model(path, kv_cache="int2")
    odd = make_checkpoint(tmp_path / "odd", hidden_size=80, num_attention_heads=4, num_key_value_heads=2)  # head_dim 20
    with pytest.raises(QliteError, match="--kv-cache int4: .*head_dim 20 is not a multiple of 32"):
        load_model(odd, kv_cache="int4")
