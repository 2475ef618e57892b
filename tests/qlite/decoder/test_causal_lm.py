"""qlite's decoder against transformers' Qwen2ForCausalLM on tiny random checkpoints."""
import pytest
import torch

from tiny_models import hf_model, make_checkpoint
from qlite.loader import load_model
from qlite.decode import generate_tokens
from qlite.generate import SamplingParams


def test_logits_match_transformers(tiny_variant):
    name, path = tiny_variant
    ours, ref = load_model(path, dtype="float32"), hf_model(path)
    ids = torch.randint(0, ours.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids) - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs diff {diff}"


def test_sharded_checkpoint_loads_the_same(tmp_path):
    whole = make_checkpoint(tmp_path / "whole", seed=3)
    sharded = make_checkpoint(tmp_path / "sharded", seed=3, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 500, (1, 9))
    with torch.no_grad():
        a = load_model(whole, dtype="float32")(ids)
        b = load_model(sharded, dtype="float32")(ids)
        ref = hf_model(sharded)(ids).logits
    assert torch.equal(a, b)
    assert (b - ref).abs().max() <= 1e-4


def reference_greedy(ref, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = ref(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_greedy_generation_matches_transformers(tiny_variant):
    _, path = tiny_variant
    ours, ref = load_model(path, dtype="float32"), hf_model(path)
    prompt = [5, 17, 99, 3, 250, 41]
    got = [int(t[0]) for t in generate_tokens(ours, [prompt], SamplingParams(max_new_tokens=12), eos_ids=())]
    assert got == reference_greedy(ref, prompt, 12)


def test_kv_cache_decoding_equals_recomputation(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype="float32")
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 32)
        pieces = [model(ids[:, :8], cache), model(ids[:, 8:13], cache)]  # prefill, then a chunk
        pieces += [model(ids[:, t:t + 1], cache) for t in range(13, 20)]  # one token at a time
    assert cache.length == 20
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= 1e-5


def test_kv_cache_grows_as_tokens_come_up_to_its_limit(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype="float32")
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 3, limit=20)
        pieces = [model(ids[:, :5], cache)] + [model(ids[:, t:t + 1], cache) for t in range(5, 20)]
        assert (cache.capacity, cache.length) == (20, 20)  # 3 -> 5 -> 10 -> 20
        with pytest.raises(ValueError, match="at most 20 tokens"):
            model(ids[:, :1], cache)
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= 1e-5


def test_a_prompt_goes_into_the_cache_in_chunks(tiny_ckpt, monkeypatch):
    """A prompt longer than prefill_chunk is prefilled chunk by chunk (activations bounded by the
    chunk) and gives one forward's logits, cache and next tokens, a left-padded batch too."""
    model = load_model(tiny_ckpt, dtype="float32")
    ids = torch.randint(0, 500, (2, 23), generator=torch.Generator().manual_seed(4))
    key_mask = torch.ones(2, 23, dtype=torch.bool)
    key_mask[1, :6] = False  # row 1 left-padded
    seen = []
    monkeypatch.setattr(type(model), "hidden_states",
                        lambda self, ids, *a, f=type(model).hidden_states: seen.append(ids.shape[1]) or f(self, ids, *a))
    with torch.no_grad():
        whole_cache, chunked_cache = model.new_cache(2, 23), model.new_cache(2, 23)
        whole = model(ids, whole_cache, key_mask=key_mask)
        model.prefill_chunk = 5
        chunked = model(ids, chunked_cache, key_mask=key_mask)
        last = model(ids, model.new_cache(2, 23), key_mask=key_mask, last_only=True)
        heads = []
        monkeypatch.setattr(model.lm_head, "forward", lambda x, f=model.lm_head.forward: heads.append(x.shape) or f(x))
        filled = model.new_cache(2, 23)
        assert model(ids, filled, key_mask=key_mask, head=False) is None and heads == []  # the cache alone
    assert (filled.k - chunked_cache.k).abs().max() == 0 and filled.length == 23
    assert seen == [23, 5, 5, 5, 5, 3] + [5, 5, 5, 5, 3] + [5, 5, 5, 5, 3]
    assert (chunked - whole).abs().max() <= 1e-5 and (last - chunked[:, -1:]).abs().max() <= 1e-5
    assert (chunked_cache.k - whole_cache.k).abs().max() <= 1e-5 and chunked_cache.length == 23
    params = SamplingParams(max_new_tokens=8)
    chunked_tokens = list(generate_tokens(model, [ids[0].tolist()], params, eos_ids=()))
    model.prefill_chunk = 512
    assert chunked_tokens == list(generate_tokens(model, [ids[0].tolist()], params, eos_ids=()))


def test_left_padded_batch_gives_each_prompts_tokens(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype="float32")
    prompts = [[7, 8, 9, 10, 11, 12, 13], [300, 301], [42, 43, 44, 45]]
    params = SamplingParams(max_new_tokens=10)
    batch = torch.stack(list(generate_tokens(model, prompts, params, eos_ids=(), pad_id=0)), dim=1)
    for row, p in enumerate(prompts):
        alone = [int(t[0]) for t in generate_tokens(model, [p], params, eos_ids=())]
        assert batch[row].tolist() == alone


def test_bf16_runs_close_to_float32(tiny_ckpt):
    ids = torch.randint(0, 500, (1, 16))
    with torch.no_grad():
        a = load_model(tiny_ckpt, dtype="float32")(ids)
        b = load_model(tiny_ckpt, dtype="bfloat16")(ids).float()
    assert b.dtype == torch.float32 and (a - b).abs().max() < 0.05 * a.abs().max()


def test_fused_projections_hold_the_checkpoint_rows_in_order(tiny_ckpt):
    from safetensors.torch import load_file
    model = load_model(tiny_ckpt, dtype="float32")
    src = load_file(tiny_ckpt / "model.safetensors")
    attn, mlp, p = model.model.layers[1].self_attn, model.model.layers[1].mlp, "model.layers.1."
    assert torch.equal(attn.qkv_proj.weight, torch.cat([src[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]))
    assert torch.equal(attn.qkv_proj.bias, torch.cat([src[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([src[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")]))
