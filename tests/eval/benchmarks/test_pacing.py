"""eval.benchmarks.pacing: speculation replayed over fixed outputs under a fixed cost model."""
import pytest
import torch
from click.testing import CliRunner

from eval.benchmarks.pacing import OneKind, main, replay, table
from qlite import native
from qlite.speculate import Answers, PromptLookup
from tiny_models import NATIVE_WIDTHS, make_checkpoint


def test_output_that_copies_the_prompt_is_drafted_and_output_that_repeats_nothing_is_not():
    code = torch.randint(0, 1000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    speed, per_pass = replay(code + code, 200, 0.35, PromptLookup())
    assert speed > 2.0 and per_pass > 4.0  # the prompt back: nearly every proposal taken
    fresh = list(range(400))  # no token twice: nothing to look up, plain steps only
    assert replay(fresh, 200, 0.35, PromptLookup()) == (1.0, 1.0)


def test_kinds_apart_beat_one_estimate_where_short_matches_mislead():
    """Text whose 1-gram matches never continue (every bigram new) but whose long matches do (a copied
    block): one estimate, dragged down by the short matches, proposes less of the block."""
    gen = torch.Generator().manual_seed(1)
    noise = [int(t) for t in torch.randint(0, 40, (600,), generator=gen)]  # small vocabulary: 1-gram matches
    block = [int(t) for t in torch.randint(100, 10_000, (60,), generator=gen)]
    tokens = block + noise[:300] + block + noise[300:] + block
    kinds, _ = replay(tokens, 60, 0.35, PromptLookup())
    one, _ = replay(tokens, 60, 0.35, OneKind(PromptLookup()))
    assert kinds > one > 0.9


def test_the_table_has_a_row_per_set_and_row_cost():
    streams = {"a": [(list(range(50)) * 2, 50)], "b": [(list(range(100, 180)), 40)]}
    rows = table(streams, [0.3, 0.5]).splitlines()[2:]
    assert [r.split(" | ")[0::2][:2] for r in rows] == [["| a", "0.3"], ["| a", "0.5"], ["| b", "0.3"], ["| b", "0.5"]]
    assert rows[2].endswith("| 1.000 (1.00) | 1.00 " * 3 + "|")


def test_an_answer_like_an_earlier_one_is_drafted_from_it_unless_the_lookup_forgets_answers():
    """The second prompt's answer repeats the first's (not its own prompt): only a lookup that remembers
    earlier answers proposes it."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 500, (40,), generator=gen).tolist() for _ in range(2)]
    answer = (1000 + torch.randperm(1000, generator=gen)[:120]).tolist()  # no token twice
    remembers, forgets = PromptLookup(), PromptLookup(answers=Answers(most=0))
    for lookup in (remembers, forgets):
        assert replay(prompts[0] + answer, 40, 0.35, lookup) == (1.0, 1.0)  # nothing earlier to draw on
    assert replay(prompts[1] + answer, 40, 0.35, forgets) == (1.0, 1.0)
    speed, per_pass = replay(prompts[1] + answer, 40, 0.35, remembers)
    assert speed > 2.0 and per_pass > 4.0


@pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")
def test_the_command_on_a_tiny_model(tmp_path):
    src = make_checkpoint(tmp_path / "bf16", **{**NATIVE_WIDTHS, "max_position_embeddings": 4096})
    r = CliRunner().invoke(main, [str(src), "--sets", "prose", "--limit", "2", "--new-tokens", "8", "--threads", "1",
                                  "--row-costs", "0.3"])
    assert r.exit_code == 0, r.output
    assert [line.split(" | ")[:3] for line in r.output.splitlines()[2:]] == [["| prose", "2", "0.3"]]
    r = CliRunner().invoke(main, [str(src), "--row-costs", "a,b"])
    assert r.exit_code == 2 and "--row-costs" in r.output
