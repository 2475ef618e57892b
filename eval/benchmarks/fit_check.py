"""`qlite info --ctx` against what a run takes: for each context, `qlite generate` in a fresh process
on a prompt of that many tokens (less the reply's), its peak RSS (VmHWM, read by the process itself as
it exits: wait4's figure would count the parent's pages a forked child starts with) beside the
estimate for the same run.

    python -m eval.benchmarks.fit_check DIR [--ctx 2048,8192,16384] [--kv-cache int8] [--new-tokens 32]
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click


# `qlite ARGS` that writes its own peak RSS on stderr as it exits
REPORTING_QLITE = ("import atexit, sys\n"
                   "from qlite.memory import peak_rss_bytes\n"
                   "atexit.register(lambda: sys.stderr.write(f'\\nqlite-peak-rss {peak_rss_bytes()}\\n'))\n"
                   "from qlite.cli import main\n"
                   "sys.exit(main(sys.argv[1:]))")


def peak_rss_of(args: list[str], stdin: str) -> int:
    """Run `qlite ARGS` to the end in a fresh process; its peak resident memory in bytes."""
    cmd = [sys.executable, "-c", REPORTING_QLITE, *args]
    run = subprocess.run(cmd, input=stdin.encode(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    err = run.stderr.decode()
    if run.returncode:
        raise click.ClickException(f"qlite {' '.join(args)} failed: {err.strip()[-300:]}")
    return int(err.rsplit("qlite-peak-rss ", 1)[1].split()[0])


@click.command()
@click.argument("model_dir", type=click.Path(path_type=Path, exists=True))
@click.option("--ctx", default="2048,8192,16384", show_default=True, help="contexts (prompt + reply), comma-separated")
@click.option("--kv-cache", default="bf16", show_default=True)
@click.option("--new-tokens", default=32, show_default=True)
def main(model_dir, ctx, kv_cache, new_tokens):
    from qlite import fit
    from qlite.checkpoint import CheckpointDir
    from qlite.kv_quant import KINDS
    from qlite.texts import load_text
    from qlite.tokenizer import Tokenizer

    import torch

    from qlite.loader import resolve_dtype

    tokenizer, ckpt = Tokenizer(model_dir), CheckpointDir(model_dir)
    run_dtype = resolve_dtype("auto", torch.device("cpu"))  # what generate runs in
    code = tokenizer.encode(load_text("code"))
    lines = ["| context | estimate MiB | measured peak RSS MiB | estimate / measured |", "|---|---|---|---|"]
    for n in (int(c) for c in ctx.split(",")):
        prompt = tokenizer.decode(code[:n - new_tokens])
        tokens = len(tokenizer.encode(prompt)) + new_tokens
        measured = peak_rss_of(["generate", "-m", str(model_dir), "--raw", "--max-new-tokens", str(new_tokens),
                                "--kv-cache", kv_cache], prompt)
        estimate = fit.need(ckpt, tokens, 1, KINDS[kv_cache], run_dtype).total
        lines.append(f"| {tokens} | {estimate / 2**20:.0f} | {measured / 2**20:.0f} | {estimate / measured:.3f} |")
        click.echo(lines[-1], err=True)
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
