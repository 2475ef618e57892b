import pytest
import torch

from qlite.loader import load_model
from qlite.errors import QliteError
from qlite.decode import detokenize, generate_tokens, stream_text
from qlite.generate import (SamplingParams, apply_repetition_penalty, filter_min_p, filter_top_k, filter_top_p,
                            next_token, top_k_candidates, top_p_candidates)
from qlite.tokenizer import Tokenizer

NEG = float("-inf")


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    assert filter_top_k(logits, 2).tolist() == [[NEG, 4.0, 3.0, NEG]]
    assert torch.equal(filter_top_k(logits, 0), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(filter_top_p(logits, p))[0].tolist()
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.9) == [True, True, True, False]
    assert kept(1.0) == [True, True, True, True]


def test_min_p_keeps_tokens_at_least_p_times_the_top_one():
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08]])
    kept = lambda p: torch.isfinite(filter_min_p(probs.log(), p))[0].tolist()
    assert kept(0.0) == [True, True, True, True]
    assert kept(0.2) == [True, True, True, False]  # floor 0.1
    assert kept(0.5) == [True, True, False, False]  # floor 0.25
    assert kept(0.99) == [True, False, False, False]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -4.0, 1.0]]


def test_sampling_follows_the_distribution_and_the_seed():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(20000, 3)
    params = SamplingParams(temperature=1.0, seed=0)
    draw = lambda: next_token(logits, params, None, torch.Generator().manual_seed(0))
    a, b = draw(), draw()
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / len(a)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.02)
    hot = next_token(logits, SamplingParams(temperature=100.0), None, torch.Generator().manual_seed(0))
    assert (torch.bincount(hot, minlength=3).float() / len(hot)).min() > 0.3  # near uniform


@pytest.mark.parametrize("k, top_p, min_p", [(5, 1.0, 0.0), (5, 0.6, 0.0), (8, 0.9, 0.05), (30, 0.95, 0.0)])
def test_top_k_candidates_give_the_whole_vocabulary_distribution(k, top_p, min_p):
    """Filtering the top-k candidates (ties at the k-th included) gives exactly the distribution that
    filtering all logits gives; bf16-rounded logits have ties, and row 1 has one at its k-th."""
    logits = (torch.randn(4, 2000, generator=torch.Generator().manual_seed(k)) * 3).bfloat16().float()
    top = logits[1].topk(k).values
    logits[1, logits[1] < top[-1]] = torch.where(torch.rand(2000) < 0.01, top[-1], logits[1])[logits[1] < top[-1]]
    full = filter_min_p(filter_top_p(filter_top_k(logits, k), top_p), min_p).softmax(-1)
    values, ids = top_k_candidates(logits, k)
    assert ids.shape[1] > k  # the ties came along
    few = filter_min_p(filter_top_p(values, top_p), min_p).softmax(-1)
    assert torch.allclose(torch.zeros_like(full).scatter(-1, ids, few), full, atol=1e-7)


@pytest.mark.parametrize("top_p, min_p", [(0.5, 0.0), (0.9, 0.0), (0.95, 0.02)])
def test_top_p_candidates_give_the_whole_vocabulary_distribution(top_p, min_p):
    """Without top-k, top-p looks among the largest logits first (probabilities over the whole row):
    the same kept set and distribution as sorting the whole row, ties included; None, and the
    whole-row path, when the kept set could reach past the candidates."""
    logits = (torch.randn(3, 20000, generator=torch.Generator().manual_seed(1)) * 4).bfloat16().float()
    full = filter_min_p(filter_top_p(logits, top_p), min_p).softmax(-1)
    values, ids = top_p_candidates(logits, top_p)
    few = filter_min_p(values, min_p).softmax(-1)
    assert torch.allclose(torch.zeros_like(full).scatter(-1, ids, few), full, atol=1e-7)
    flat = torch.zeros(2, 20000)  # every token alike: the kept set is most of the row
    assert top_p_candidates(flat, top_p) is None
    assert next_token(flat, SamplingParams(temperature=1.0, top_p=top_p), None, None).shape == (2,)


def test_top_k_of_all_but_one_drops_the_least_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    tokens = next_token(logits.expand(2000, 4), SamplingParams(temperature=1.0, top_k=3), None,
                        torch.Generator().manual_seed(0))
    assert 3 not in tokens.tolist() and {0, 1, 2} <= set(tokens.tolist())


def test_top_k_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.4, 0.05, 0.3, 0.1, 0.15] + [1e-4] * 95))[None].expand(20000, 100)
    tokens = next_token(logits, SamplingParams(temperature=1.0, top_k=3), None, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=100).float() / len(tokens)
    assert torch.allclose(freq[[0, 2, 4]], torch.tensor([0.4, 0.3, 0.15]) / 0.85, atol=0.02)
    assert freq[[0, 2, 4]].sum() == 1


@pytest.mark.parametrize("kwargs, field", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                           (dict(temperature=float("nan")), "temperature"), (dict(top_k=-2), "top_k"),
                                           (dict(repetition_penalty=float("inf")), "repetition_penalty"),
                                           (dict(max_new_tokens=0), "max_new_tokens"), (dict(min_p=1.0), "min_p"),
                                           (dict(min_p=-0.1), "min_p")])
def test_bad_sampling_settings_are_named(kwargs, field):
    with pytest.raises(QliteError, match=f"^{field} must"):
        SamplingParams(**kwargs)


def test_stops_at_eos_max_tokens_and_context(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype="float32")
    prompt = [10, 20, 30]
    free = [int(t[0]) for t in generate_tokens(model, [prompt], SamplingParams(max_new_tokens=8), eos_ids=())]
    assert len(free) == 8
    stopped = [int(t[0]) for t in generate_tokens(model, [prompt], SamplingParams(max_new_tokens=8),
                                                  eos_ids=(free[3],))]
    assert stopped == free[:free.index(free[3]) + 1]
    ctx = model.config.max_position_embeddings
    long_prompt = [5] * (ctx - 4)
    out = list(generate_tokens(model, [long_prompt], SamplingParams(max_new_tokens=100), eos_ids=()))
    assert len(out) == 4
    with pytest.raises(QliteError, match=f"prompt is {ctx} tokens, the model's context is {ctx}"):
        next(generate_tokens(model, [[5] * ctx], SamplingParams(), eos_ids=()))


def test_detokenize_ends_at_eos_and_before_stop_strings(tiny_ckpt):
    tok = Tokenizer(tiny_ckpt)
    text = "the thin tin ends here. ignored"
    ids = tok.encode(text)
    eos = tok.token_id("<|im_end|>")
    assert "".join(detokenize(ids + [eos] + ids, tok, eos_ids=(eos,))) == text
    pieces = list(detokenize(ids, tok, eos_ids=(eos,), stop=("here.", "zzz")))
    assert "".join(pieces) == "the thin tin ends "
    assert "".join(detokenize(ids, tok, eos_ids=(), stop=("the",))) == ""


def test_stream_text_is_the_decoded_greedy_tokens(tiny_ckpt):
    model, tok = load_model(tiny_ckpt, dtype="float32"), Tokenizer(tiny_ckpt)
    prompt = tok.encode("the thin tin")
    params = SamplingParams(max_new_tokens=12)
    ids = [int(t[0]) for t in generate_tokens(model, [prompt], params, eos_ids=())]
    text = "".join(stream_text(model, tok, prompt, params, eos_ids=()))
    assert text == tok.decode(ids, skip_special_tokens=True)


def test_repetition_penalty_sees_real_tokens_only_in_a_padded_batch(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype="float32")
    params = SamplingParams(max_new_tokens=6, repetition_penalty=1.5)
    prompts = [[7, 0], [9, 10, 11, 12, 13]]  # token 0 is also the pad id: the first prompt really contains it
    batch = torch.stack(list(generate_tokens(model, prompts, params, eos_ids=(), pad_id=0)), dim=1)
    for row, p in enumerate(prompts):
        assert batch[row].tolist() == [int(t[0]) for t in generate_tokens(model, [p], params, eos_ids=())]


def test_python_api_takes_messages_threads_and_home_paths(tiny_ckpt, monkeypatch):
    import qlite

    monkeypatch.setenv("HOME", str(tiny_ckpt.parent))
    before = torch.get_num_threads()
    try:
        lm = qlite.load(f"~/{tiny_ckpt.name}", dtype="float32", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the"},
                {"role": "assistant", "content": "in"}, {"role": "user", "content": "he"}]
    rendered = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert lm.prompt_ids(messages) == lm.tokenizer.encode(rendered)
    assert lm.generate(messages, max_new_tokens=5) == lm.generate(rendered, chat=False, max_new_tokens=5)
    for bad, where in [([], "non-empty list"), ([{"role": "robot", "content": "x"}], "messages\\[0\\]"),
                       ([{"role": "user", "content": 3}], "messages\\[0\\]")]:
        with pytest.raises(QliteError, match=where):
            lm.prompt_ids(bad)
    with pytest.raises(QliteError, match="threads 0"):
        qlite.load(tiny_ckpt, threads=0)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 5e-324])
def test_a_tiny_temperature_samples_as_its_limit_greedy_does(temperature):
    """logits / 1e-300 once overflowed to inf and blamed the weights ("overflowed")."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9], [3.0, -3.0, 0.0, 2.5]])
    tokens = next_token(logits, SamplingParams(temperature=temperature), None, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1, 0]
