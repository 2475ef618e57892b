"""Speculative decoding: the verify forward's logits bit for bit what one-token steps give (every kind of
product, quantized caches, both instruction sets), so speculative output is plain decoding's, greedy and
sampled; the cache rolled back past rejected proposals; the drafter and the pacer; the CLI."""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from qlite import native
from qlite.cli import main
from qlite.decode import Sequence, decode_batch, stream_text
from qlite.errors import QliteError
from qlite.generate import SamplingParams
from qlite.loader import load_model
from qlite.speculate import (MAX_DRAFT, Answers, DraftModel, Drafter, Pacer, PromptLookup, Speculation, Stats,
                             decode_speculative)
from qlite.tokenizer import Tokenizer
from tiny_models import NATIVE_WIDTHS, make_checkpoint

needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
REPEATS = [5, 6, 7, 8, 9, 10, 11, 12] * 3  # a prompt whose continuation lookups can guess


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from quantize.convert import convert
    src = make_checkpoint(tmp_path_factory.mktemp("spec") / "bf16", seed=4, **NATIVE_WIDTHS)
    out = {"bf16": src}
    for name, bits, group in (("int8", 8, None), ("int4", 4, 64), ("int4-g128", 4, 128)):
        out[name] = convert(src, src.parent / name, bits=bits, group_size=group, progress=False, report=False).out_dir
    return out


def stepped_and_verified(model, prompt, feed):
    """Logits after each token of `feed` following `prompt`: one-token steps, and one exact forward."""
    results = []
    for exact in (False, True):
        cache = model.new_cache(1, len(prompt) + 1, limit=len(prompt) + len(feed))  # grows as generate's does
        with torch.inference_mode():
            model(torch.tensor([prompt]), cache, last_only=True)
            if exact:
                results.append(model(torch.tensor([feed]), cache, exact=True)[0])
            else:
                results.append(torch.cat([model(torch.tensor([[t]]), cache)[0] for t in feed]))
        assert cache.length == len(prompt) + len(feed)
    return results


@needs_native
@pytest.mark.usefixtures("native_isa")
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4", "int4-g128"])
@pytest.mark.parametrize("kv_cache", ["bf16", "int8", "int4"])
def test_the_verify_forward_is_the_steps_bit_for_bit(ckpts, kind, kv_cache):
    model = load_model(ckpts[kind], kv_cache=kv_cache)
    stepped, verified = stepped_and_verified(model, list(range(3, 40)), [41, 7, 99, 3, 250, 17, 8, 60])
    assert torch.equal(stepped, verified)
    assert not torch.equal(stepped[1:], stepped[:-1])  # the rows are different positions


@needs_native
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_without_exact_a_forward_of_several_tokens_is_the_steps_too(ckpts, kind):
    """The plain multi-token forward (the prefill path) reads every key and value back from the cache as a
    step does, on row-exact products: the same bits as the steps (it rounded differently before issue 54)."""
    model = load_model(ckpts[kind])
    prompt, feed = list(range(3, 40)), [41, 7, 99, 3, 250, 17, 8, 60]
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model(torch.tensor([prompt]), cache)
        plain = model(torch.tensor([feed]), cache)[0]
    stepped, _ = stepped_and_verified(model, prompt, feed)
    assert torch.equal(plain, stepped)


def decode(model, prompt, params, speculation=None, eos=(263,)):
    seq = Sequence(prompt, params, eos_ids=eos, vocab_size=model.config.vocab_size)
    steps = ((t, e) for [(t, e)] in decode_batch(model, [prompt], [seq])) if speculation is None \
        else speculation.decode(model, prompt, seq)
    return [t for t, _ in steps], seq


@needs_native
@pytest.mark.usefixtures("native_isa")
@pytest.mark.parametrize("kind", ["bf16", "int4"])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40),
                                   SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=3, max_new_tokens=40),
                                   SamplingParams(temperature=1.3, repetition_penalty=1.2, seed=11, max_new_tokens=40)],
                         ids=["greedy", "sampled", "penalised"])
def test_speculative_output_is_plain_decodings(ckpts, kind, params):
    model = load_model(ckpts[kind])
    plain, _ = decode(model, REPEATS, params)
    spec = Speculation.named("lookup", model)
    fast, seq = decode(model, REPEATS, params, spec)
    assert fast == plain and seq.generated == len(plain)
    assert spec.stats.tokens == len(plain) and spec.stats.proposed > 0  # (taken ones: the oracle below)


@needs_native
def test_rejected_proposals_are_rolled_back(ckpts, monkeypatch):
    """A drafter that is always wrong: every proposal rejected, the cache cut back each pass, the output
    still plain decoding's; one that is always right (the plain output itself): every proposal taken."""
    model = load_model(ckpts["int4"])
    params = SamplingParams(max_new_tokens=30)
    plain, _ = decode(model, [3, 4, 5], params)

    class Wrong(Drafter):
        def propose(self, tokens, k):
            return [(plain[len(tokens) - 3] + 1) % 500] * k if len(tokens) - 3 < len(plain) else []

    class Oracle(Drafter):
        def propose(self, tokens, k):
            return plain[len(tokens) - 3:len(tokens) - 3 + k]

    monkeypatch.setattr(Pacer, "cost", lambda self, rows: 1 + Pacer.ROW_COST * (rows - 1))  # not this machine's
    for drafter, accepted in ((Wrong(), 0), (Oracle(), None)):
        stats, seq = Stats(), Sequence([3, 4, 5], params, eos_ids=[263])
        out = [t for t, _ in decode_speculative(model, [3, 4, 5], seq, drafter, stats=stats)]
        assert out == plain
        assert stats.accepted == (accepted if accepted is not None else stats.proposed) and stats.proposed > 0
    assert stats.passes <= len(plain) // 2  # the oracle: up to 8 tokens a pass


@needs_native
def test_the_context_and_token_budget_bound_the_proposals(ckpts):
    model = load_model(ckpts["int4"])
    context = model.config.context_length
    prompt = (REPEATS * 12)[:context - 5]
    plain, seq = decode(model, prompt, SamplingParams(max_new_tokens=50))
    fast, spec_seq = decode(model, prompt, SamplingParams(max_new_tokens=50), Speculation.named("lookup", model))
    assert fast == plain and len(fast) == 5 and spec_seq.generated == 5  # the context ends it
    budget, _ = decode(model, REPEATS, SamplingParams(max_new_tokens=3), Speculation.named("lookup", model))
    assert len(budget) == 3


@needs_native
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=40),
                                   SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=3, max_new_tokens=40)],
                         ids=["greedy", "sampled"])
def test_a_4bit_draft_model_speculates_for_the_8bit_model_exactly(ckpts, params, monkeypatch):
    """Quantized self-speculation: the int4 checkpoint of the same weights proposes, the int8 one decides;
    its output is the int8 model's own. (Passes cost what the pacer's model says, not what they take here:
    on these tiny models a draft step costs as much as the model's, and the pacer would rightly not propose.)"""
    monkeypatch.setattr(Pacer, "cost", lambda self, rows: 1 + Pacer.ROW_COST * (rows - 1))
    model = load_model(ckpts["int8"])
    plain, _ = decode(model, [3, 4, 5, 6], params)
    spec = Speculation.named(str(ckpts["int4"]), model, tokenizer=Tokenizer(ckpts["int8"]))
    assert isinstance(spec.drafter, DraftModel)
    fast, seq = decode(model, [3, 4, 5, 6], params, spec)
    assert fast == plain and seq.generated == len(plain)
    assert spec.stats.proposed > 0 and (spec.stats.accepted > 0 or params.temperature)


@needs_native
def test_a_draft_models_cache_follows_the_sequence_it_is_asked_about(ckpts):
    """The first proposals are the draft model's own greedy continuation; later ones come from its cache
    rolled back to what the new sequence shares with the old, so what the old one held past that cannot
    matter: two drafts that saw different sequences with the same shared part propose the same. (A fresh
    draft may not: it feeds the shared part in another forward, whose roundings differ.)"""
    draft = load_model(ckpts["int4"])
    greedy, _ = decode(draft, [3, 4, 5, 6, 7], SamplingParams(max_new_tokens=4), eos=())
    assert DraftModel(draft).propose([3, 4, 5, 6, 7], 4) == greedy
    for before_a, before_b, now in (([3, 4, 5, 9, 9, 9, 9], [3, 4, 5, 1, 2], [3, 4, 5, 6, 7]),
                                    ([3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 1], [3, 4, 5, 6, 7, 8, 20, 21])):
        a, b = DraftModel(draft), DraftModel(draft)
        a.propose(before_a, 5), b.propose(before_b, 2)
        assert a.propose(now, 4) == b.propose(now, 4)
        assert a.fed[:len(now)] == now
    assert a.propose(list(range(3, 20)), 0) == []


@needs_native
def test_a_draft_model_with_another_tokenizer_is_refused(ckpts, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(ckpts["int4"], other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped: same size, another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(QliteError, match=r"tokenizer.json is not the model's tokenizer \(4 token entries differ\)"):
        Speculation.named(str(other), load_model(ckpts["int8"]), tokenizer=Tokenizer(ckpts["int8"]))


@needs_native
@pytest.mark.parametrize("draft_vocab", [300, 640])
def test_a_draft_with_another_vocab_size_speculates_exactly(ckpts, tmp_path, monkeypatch, draft_vocab):
    """The same tokenizer file, embeddings of another size (as Qwen2.5 0.5B's 151,936 rows and 7B's 152,064):
    printed a few tokens, then IndexError (the model's token past the draft's rows, or the draft's proposal past
    the model's). A sequence holding a token the draft has no row for is not drafted, and a proposal the model
    has no row for ends the proposals: the output is plain decoding's."""
    monkeypatch.setattr(Pacer, "cost", lambda self, rows: 1 + Pacer.ROW_COST * (rows - 1))
    draft = make_checkpoint(tmp_path / "draft", seed=4, **dict(NATIVE_WIDTHS, vocab_size=draft_vocab))
    model = load_model(ckpts["int8"])
    params = SamplingParams(max_new_tokens=24)
    for prompt in (REPEATS, [3, 4, 5, 6], list(range(20, 40)), [7, 7, 7], list(range(100, 140, 3))):
        plain, _ = decode(model, prompt, params)
        # the case met: drafting starts, then (the smaller draft) the model says what the draft cannot read
        if plain[0] < draft_vocab and (draft_vocab > model.config.vocab_size or max(plain) >= draft_vocab):
            break
    else:
        pytest.fail("no prompt meets the case")
    spec = Speculation.named(str(draft), model, tokenizer=Tokenizer(ckpts["int8"]))
    fast, _ = decode(model, prompt, params, spec)
    assert fast == plain and spec.stats.proposed > 0


@needs_native
def test_a_draft_without_a_row_for_every_token_is_refused(ckpts, tmp_path):
    draft = make_checkpoint(tmp_path / "draft", seed=4, **dict(NATIVE_WIDTHS, vocab_size=300))
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(dict(config, vocab_size=264)))  # fewer rows than the tokenizer's ids
    size = Tokenizer(ckpts["int8"]).tok.get_vocab_size()
    with pytest.raises(QliteError, match=f"the draft's vocab_size is 264 and the model's 512, but their tokenizer "
                                         f"has {size} tokens"):
        Speculation.named(str(draft), load_model(ckpts["int8"]), tokenizer=Tokenizer(ckpts["int8"]))


def test_prompt_lookup_proposes_what_followed_the_longest_most_recent_match():
    lookup = PromptLookup(max_ngram=3)
    assert lookup.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest [1, 2, 3]
    assert lookup.propose([4, 5, 6, 1, 2, 9, 2], 3) == [9, 2]  # no 3- or 2-gram: the 1-gram [2], cut at the end
    assert lookup.propose([1, 2, 3, 4], 4) == []
    assert lookup.propose([7], 4) == []
    assert lookup.propose([1, 2, 1, 2, 1, 2], 3) == [1, 2]
    assert [lookup.match(t) for t in ([1, 2, 3, 9, 1, 2, 3], [4, 5, 6, 1, 2, 9, 2], [1, 2, 3, 4])] == [3, 1, 0]


def test_prompt_lookup_indexes_a_growing_sequence_as_a_scan_finds_it():
    """The index, extended token by token (and several at a time) as a history grows, proposes what a scan of
    the whole list does at every length; a sequence of its own (for_sequence) starts from nothing."""
    def scan(tokens, k, max_ngram=3):
        for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i:i + n] == tokens[len(tokens) - n:]:
                    return tokens[i + n:i + n + k]
        return []
    stream = torch.randint(0, 6, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    lookup, history = PromptLookup().for_sequence(), []
    for i, token in enumerate(stream):
        history.append(token)
        if i % 3 == 0:  # proposals asked for after one, two or three new tokens
            assert lookup.propose(history, 5) == scan(history, 5, lookup.max_ngram), i
    assert lookup.for_sequence().indexed == 0 and lookup.indexed == len(stream)


def test_prompt_lookup_draws_on_earlier_answers_where_the_sequence_has_no_long_match_of_its_own():
    shared = PromptLookup()
    shared.remember([10, 11, 12, 13, 14, 15, 16])
    lookup = shared.for_sequence()  # the answers are every sequence's
    assert lookup.match([1, 10, 11, 12]) == PromptLookup.ANSWER_KINDS + 3
    assert lookup.propose([1, 10, 11, 12], 3) == [13, 14, 15]
    assert lookup.propose([1, 10, 11, 12], 9) == [13, 14, 15, 16]  # not past the answer's end
    assert lookup.propose([12, 50, 10, 11, 12], 2) == [13, 14]  # its own 1-gram [12] is shorter
    assert lookup.propose([10, 11, 12, 99, 10, 11, 12], 2) == [99, 10]  # its own 3-gram goes first
    assert lookup.propose([5, 11, 12], 2) == []  # an answer's 2-gram is not enough
    assert lookup.propose([9, 14, 15, 16], 2) == []  # an answer's end: nothing after


def test_earlier_answers_keep_the_newest_within_their_bound():
    answers = Answers(max_ngram=4, most=20)
    for a in ([1, 2, 3, 4, 5, 6, 7, 8], [21, 22, 23, 24, 25, 26, 27, 28], [31, 32, 33, 34, 35, 36, 37, 38]):
        answers.add(a)
    assert len(answers.tokens) <= 20
    assert answers.match([1, 2, 3]) == (0, None)  # the oldest forgotten
    for first in (21, 31):
        n, end = answers.match([first, first + 1, first + 2])
        assert n == 3 and answers.after(end, 3) == [first + 3, first + 4, first + 5]
    answers.add(list(range(100, 125)))  # longer than the bound: not kept
    assert answers.match([31, 32, 33])[0] == 3 and answers.match([100, 101, 102]) == (0, None)


@needs_native
def test_a_speculation_drafts_from_its_earlier_answers(ckpts, monkeypatch):
    """The same prompt decoded twice with one Speculation: the first answer, remembered, is proposed for the
    second. (Passes cost what the pacer's model says: on a tiny model it would rightly find proposals not
    worth their rows.)"""
    monkeypatch.setattr(Pacer, "cost", lambda self, rows: 1 + Pacer.ROW_COST * (rows - 1))
    model = load_model(ckpts["bf16"])
    prompt, params = list(range(40, 60)), SamplingParams(max_new_tokens=40)
    plain, _ = decode(model, prompt, params)
    spec = Speculation.named("lookup", model)
    first, _ = decode(model, prompt, params, spec)
    taken = spec.stats.accepted
    second, _ = decode(model, prompt, params, spec)
    assert first == second == plain
    assert spec.drafter.answers.tokens[-len(plain) - 1:-1] == plain
    assert spec.stats.accepted - taken > max(taken, len(plain) // 2)


def test_the_pacer_follows_acceptance_and_cost():
    pacer = Pacer(7)
    assert pacer.next() == 0  # a plain step first: what every pass is weighed against
    pacer.timed(1, 0.01)
    assert pacer.next() > 0
    pacer.seconds = {}
    for _ in range(10):
        pacer.update(7, 7)
    assert pacer.taken[1] > 0.95 and pacer.best() == 7  # at a step plus 0.35 a row, all 7 pay
    for rows in range(1, 9):  # rows that cost as much as a step each: no proposal pays unless all are taken
        pacer.timed(rows, 0.01 * rows)
    assert pacer.best() == 0
    pacer.seconds = {1: 0.01, 2: 0.011, 3: 0.012, 4: 0.04, 5: 0.05, 6: 0.06, 7: 0.07, 8: 0.08}
    assert pacer.best() == 2  # cheap up to 3 rows
    for _ in range(20):
        pacer.update(3, 0)
    assert pacer.taken[1] < 0.02 and pacer.best() == 0
    ks = [pacer.next() for _ in range(16)]  # plain steps, and a probe every PROBE passes
    assert ks.count(1) == 2 and ks.count(0) == 14 and ks[Pacer.PROBE - 1] == 1
    pacer.update(0, 0)  # nothing proposed: nothing learnt
    assert pacer.taken[1] < 0.02


def test_the_pacer_weighs_each_kind_of_proposal_on_its_own():
    """Prompt lookup's 1-gram matches rarely taken, its 3-gram ones mostly: proposals follow the kind on
    offer, and a hopeless kind is probed on its own count of passes."""
    pacer = Pacer(7)
    pacer.seconds = {rows: 0.01 * (1 + 0.35 * (rows - 1)) for rows in range(1, 9)}
    for _ in range(20):
        pacer.update(3, 0, kind=1)
        pacer.update(7, 6, kind=3)
    assert pacer.best(kind=1) == 0 and pacer.best(kind=3) >= 3 and pacer.best(kind=2) == pacer.best(taken=0.8)
    ks = [pacer.next(3) if i % 2 else pacer.next(1) for i in range(2 * Pacer.PROBE)]
    assert ks[1::2] == [pacer.best(kind=3)] * Pacer.PROBE  # the good kind, every time it is on offer
    assert ks[0::2] == [0] * (Pacer.PROBE - 1) + [1]  # the other: its probe after PROBE of its own passes


def test_the_pacer_prices_row_counts_not_yet_tried_by_the_nearest_one_tried():
    pacer = Pacer(7, taken=0.95)
    pacer.timed(1, 0.01)
    assert pacer.cost(4) == pytest.approx(0.01 * (1 + 3 * Pacer.ROW_COST)) and pacer.best() == 7  # the prior
    pacer.timed(8, 0.08)  # 7 proposals cost 7 steps more: so would 3 (not the prior's 1.05)
    assert pacer.cost(4) == pytest.approx(0.04) and pacer.best() == 0
    pacer.timed(3, 0.012)
    assert pacer.cost(2) == pytest.approx(0.011) and pacer.cost(6) == pytest.approx(0.01 + 0.07 * 5 / 7)
    assert pacer.best() == 4  # 4 and 5 rows priced at the slope of 3, nearer than 8: worth trying
    pacer.timed(5, 0.05)
    assert pacer.cost(4) == pytest.approx(0.04) and pacer.best() == 2  # a tie: the larger count's price


def test_the_pacer_counts_what_a_draft_model_takes_per_proposal():
    """A draft that costs a step per token never pays, however often it is right; a cheap one does."""
    draft = SimpleNamespace(seconds_per_token=0.01)
    pacer = Pacer(7, taken=0.95, drafter=draft)
    pacer.timed(1, 0.01)
    assert pacer.best() == 0 and pacer.best(taken=1.0) == 0
    assert [pacer.next() for _ in range(3 * Pacer.PROBE)] == [0] * 3 * Pacer.PROBE  # nor any probe
    draft.seconds_per_token = 0.001
    assert pacer.best() > 0


def test_speculation_is_refused_where_the_verify_pass_is_not_exact(ckpts):
    with pytest.raises(QliteError, match="--speculate: needs qlite's native CPU kernels"):
        Speculation.named("lookup", load_model(ckpts["int4"], kernel="reference"))
    with pytest.raises(QliteError, match="--speculate other/dir: 'lookup', or a draft model's checkpoint dir"):
        Speculation.named("other/dir", load_model(ckpts["int4"]), tokenizer=Tokenizer(ckpts["int4"]))
    with pytest.raises(QliteError, match=f"--draft-tokens 9: from 1 to {MAX_DRAFT}"):
        Speculation.named("lookup", load_model(ckpts["int4"]), most=9)


@needs_native
def test_generate_with_speculation_prints_plain_generates_text(ckpts, capsys):
    args = ["generate", "-m", str(ckpts["int4"]), "--raw", "-p", "abc abc abc abc abc abc", "--max-new-tokens", "24"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculate", "lookup", "--draft-tokens", "4", "--stats"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "speculation:" in out.err and "tokens per forward" in out.err
    assert main([*args, "--speculate", "draft/dir"]) == 1
    assert "--speculate draft/dir: 'lookup', or a draft model's checkpoint dir" in capsys.readouterr().err
    draft = ["generate", "-m", str(ckpts["int8"]), *args[3:]]  # the int8 model, its int4 copy drafting
    assert main(draft) == 0
    plain = capsys.readouterr().out
    assert main([*draft, "--speculate", str(ckpts["int4"]), "--stats"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "speculation:" in out.err


@needs_native
def test_stream_text_and_the_python_api_take_speculation(ckpts):
    from qlite.pipeline import load
    lm = load(ckpts["int4"])
    ids = lm.prompt_ids("abc abc abc abc", chat=False)
    params = lm.params(max_new_tokens=16)
    plain = "".join(stream_text(lm.model, lm.tokenizer, ids, params, lm.eos_ids))
    spec = Speculation.named("lookup", lm.model)
    assert "".join(stream_text(lm.model, lm.tokenizer, ids, params, lm.eos_ids, speculation=spec)) == plain
    assert lm.generate("abc abc abc abc", chat=False, max_new_tokens=16, speculate="lookup") == plain


@needs_native
def test_chat_with_speculation_replies_as_without(ckpts):
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    base = [sys.executable, "-m", "qlite", "chat", "-m", str(ckpts["int4"]), "--max-new-tokens", "12"]
    turns = "abc abc abc\nabc abc\n/exit\n"
    plain = subprocess.run(base, input=turns, capture_output=True, text=True, env=env, timeout=120)
    spec = subprocess.run([*base, "--speculate", "lookup"], input=turns, capture_output=True, text=True, env=env,
                          timeout=120)
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and plain.stdout.count("\n") == 2


@needs_native
@pytest.mark.demo
def test_the_demo_model_edits_code_speculatively_as_it_does_plainly(demo_int4, monkeypatch):
    """The real model on one code-edit prompt, 32 greedy tokens: the same tokens, proposals taken. The
    pacer is fed its own cost model's timings (Pacer.ROW_COST), not this machine's: under a loaded test run a
    slow pass made it stop proposing (CI ran beside other jobs)."""
    from eval.benchmarks.speculation import prompt_sets
    timed = Pacer.timed
    monkeypatch.setattr(Pacer, "timed", lambda self, rows, seconds: timed(self, rows, 1 + Pacer.ROW_COST * (rows - 1)))
    from qlite.pipeline import load
    lm = load(demo_int4)
    ids = lm.prompt_ids([{"role": "user", "content": prompt_sets(["code-edit"], 1)["code-edit"][0]}])
    params = SamplingParams(max_new_tokens=32)
    plain, _ = decode(lm.model, ids, params, eos=lm.eos_ids)
    spec = Speculation.named("lookup", lm.model)
    fast, _ = decode(lm.model, ids, params, spec, eos=lm.eos_ids)
    assert fast == plain and len(plain) == 32
    assert spec.stats.accepted >= 8 and spec.stats.passes < 28  # the answer copies the prompt's code
