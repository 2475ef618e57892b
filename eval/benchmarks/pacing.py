"""Speculation's pacing replayed without the clock: each prompt's greedy output is decoded once, then the
pacer and prompt lookup run over it again with every pass charged by a fixed cost model (a one-token step
1, each extra verify row `row cost` of a step) instead of its measured time, so two pacing policies compare
without timing noise (on a 2-core machine a decode's tokens/s moves by 10% between runs of one prompt).
What a pass yields is what a real one would: the proposals up to the first that differs from the output,
then the output's next token (greedy speculation is exact, so the output is the same either way).

Each row: the modelled speed-up over plain decoding (plain steps' cost over the passes', geometric mean
and min over prompts) and tokens per pass, at each row cost, for qlite's lookup (each kind of proposal
weighed on its own, the earlier prompts' answers remembered), for the lookup without earlier answers
(the sequence's own history only) and for one estimate for every kind (qlite's pacer before). Row costs
measured: the demo int4-g128 model's verify pass of R rows costs 1 + ~0.2-0.45 (R - 1) steps on 2 cores
(`python -m eval.benchmarks.kernel_bench --verify DIR`).

    python -m eval.benchmarks.pacing MODEL_DIR [--sets code-edit,open,prose] [--limit N] [--new-tokens 256]
                                    [--row-costs 0.25,0.35,0.45]
"""
from __future__ import annotations

import statistics
from types import SimpleNamespace

import click

from qlite.speculate import MAX_DRAFT, Answers, Drafter, PromptLookup, Speculator


class OneKind(Drafter):
    """A drafter's proposals as one kind: the pacer keeps one estimate for all of them."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def for_sequence(self) -> "OneKind":
        return OneKind(self.drafter.for_sequence())

    def match(self, tokens: list[int]) -> int:
        return min(self.drafter.match(tokens), 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return self.drafter.propose(tokens, k)

    def remember(self, answer: list[int]) -> None:
        self.drafter.remember(answer)


def replay(tokens: list[int], n_prompt: int, row_cost: float, drafter: Drafter, most: int = MAX_DRAFT
           ) -> tuple[float, float]:
    """(plain decoding's modelled cost over speculation's, tokens per pass) for the output tokens[n_prompt:],
    its first token given (the prompt's forward picks it either way). The proposals come from qlite's own
    Speculator; only the verify forward is replaced by the known output."""
    def cost(rows: int) -> float:
        return 1 + row_cost * (rows - 1)

    spec, seq = Speculator(drafter, most), SimpleNamespace(history=list(tokens[:n_prompt + 1]))
    spec.timed(1, cost(1))  # speculation's first pass is a plain step: the measure of the others
    spent, passes = 0.0, 0
    while len(seq.history) < len(tokens):
        draft = spec.propose(seq, len(tokens) - len(seq.history) - 1)
        truth = tokens[len(seq.history):len(seq.history) + len(draft) + 1]
        taken = next((i for i, (d, t) in enumerate(zip(draft, truth)) if d != t), len(draft))
        if draft:
            spec.pacer.update(len(draft), taken, spec.kind)
        spec.timed(1 + len(draft), cost(1 + len(draft)))
        spent, passes = spent + cost(1 + len(draft)), passes + 1
        seq.history += truth[:taken + 1]
    seq.generated = len(tokens) - n_prompt
    spec.finish(seq)
    generated = len(tokens) - n_prompt - 1
    return (generated * cost(1) / spent, generated / passes) if passes else (1.0, 1.0)


COLUMNS = {  # the drafter of each column of the table
    "qlite's": lambda: PromptLookup(),
    "no earlier answers": lambda: PromptLookup(answers=Answers(most=0)),
    "one estimate": lambda: OneKind(PromptLookup()),
}


def table(streams: dict[str, list[tuple[list[int], int]]], row_costs: list[float]) -> str:
    """Markdown: for each set and row cost, the modelled speed-up and tokens per pass of each column's drafter,
    one drafter per column and row cost for all the sets in turn (as a bench run or a server keeps one: the
    earlier answers it remembers are those of the prompts before)."""
    head = " | ".join(f"speed-up, {name} (geo. mean, min) | tokens per pass" for name in COLUMNS)
    lines = [f"| set | prompts | row cost | {head} |", "|---|---|---|" + "---|---|" * len(COLUMNS)]
    runs = {}  # (row cost, set, column) -> each prompt's (speed-up, tokens per pass)
    for rc in row_costs:
        for column, make in COLUMNS.items():
            drafter = make()
            for name, pairs in streams.items():
                runs[rc, name, column] = [replay(tokens, n, rc, drafter) for tokens, n in pairs]
    for name, pairs in streams.items():
        for rc in row_costs:
            cells = []
            for column in COLUMNS:
                speed, per_pass = zip(*runs[rc, name, column])
                cells.append(f"{statistics.geometric_mean(speed):.3f} ({min(speed):.2f}) | "
                             f"{statistics.geometric_mean(per_pass):.2f}")
            lines.append(f"| {name} | {len(pairs)} | {rc} | {' | '.join(cells)} |")
    return "\n".join(lines)


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--sets", default="code-edit,open,prose", show_default=True)
@click.option("--limit", type=int, help="at most this many prompts per set")
@click.option("--new-tokens", type=int, default=256, show_default=True)
@click.option("--row-costs", default="0.25,0.35,0.45", show_default=True,
              help="an extra verify row's cost, in steps: one row of the table each")
@click.option("--threads", type=int, default=2, show_default=True)
def main(model_dir, sets, limit, new_tokens, row_costs, threads):
    import torch

    from eval.benchmarks.speculation import plain_decode, prompt_sets
    from qlite.pipeline import load

    try:
        costs = [float(c) for c in row_costs.split(",")]
    except ValueError:
        raise click.BadParameter(f"{row_costs!r}: numbers separated by commas", param_hint="--row-costs")
    torch.set_num_threads(threads)
    lm = load(model_dir)
    streams = {}
    for name, prompts in prompt_sets(sets.split(","), limit).items():
        ids = [lm.prompt_ids([{"role": "user", "content": p}]) for p in prompts]
        streams[name] = [(p + plain_decode(lm, p, new_tokens)[0], len(p)) for p in ids]
    click.echo(table(streams, costs))


if __name__ == "__main__":
    main()
