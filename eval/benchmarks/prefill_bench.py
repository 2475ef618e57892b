"""The prefill of one prompt alone, timed in process: load a checkpoint (its default dtype and kernels), then
for each length T a forward of T random tokens into a fresh cache (last logits only), repeated; prints the
median and min-max. For comparing two trees side by side: run it with each on PYTHONPATH, in turn.

    python -m eval.benchmarks.prefill_bench MODEL_DIR 512 2048 [--kv-cache int4] [--repeats 3]
"""
from __future__ import annotations

import time

import click
import torch


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("lengths", type=int, nargs=-1, required=True)
@click.option("--kv-cache", default="bf16", show_default=True)
@click.option("--repeats", default=3, show_default=True)
def main(model_dir, lengths, kv_cache, repeats):
    from qlite.loader import load_model
    model = load_model(model_dir, kv_cache=kv_cache)
    vocab = model.config.vocab_size
    for T in lengths:
        ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(0))  # (1, T)
        seconds = []
        with torch.inference_mode():
            for _ in range(repeats):
                cache = model.new_cache(1, T)
                start = time.perf_counter()
                model(ids, cache, last_only=True)
                seconds.append(time.perf_counter() - start)
        seconds.sort()
        median = seconds[len(seconds) // 2]
        click.echo(f"T={T}: median {median:.2f} s (min {seconds[0]:.2f}, max {seconds[-1]:.2f}) = {T / median:.0f} tok/s")


if __name__ == "__main__":
    main()
