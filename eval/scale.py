"""Checkpoints of real Qwen2.5 shapes with random weights, for what the 0.5B demo model cannot show: cost
at 7B-72B (time, memory, prefill and decode speed). Every tensor of a real checkpoint, in bf16 safetensors
shards written one at a time (memory: one shard), the demo model's tokenizer beside them. For 32B and 72B
`--layers N` keeps a few layers at full width and vocabulary: the per-layer cost, which is what bounds a
streaming quantize.

    python -m eval.scale write 7b DIR [--layers N]
    python -m eval.scale measure 0.5b 7b [--recipes rtn,q4,gptq,report] [--bench] [--dir WORK] [--markdown PATH]

`measure` writes each shape's checkpoint under WORK (once), quantizes it with each recipe in a child process
(wall time and that child's own peak RSS, which it reports as it exits), and with --bench times the RTN checkpoint's load,
prefill and decode (eval.bench's runner, a fresh process). llama.cpp's peers are converted by hand
(BENCHMARKS.md says how) and timed with `eval.bench --gguf`.

Random weights make the logits meaningless (speed and memory only; acceptance rates, KLD and the like
need the real model)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import torch
from safetensors.torch import save_file

from eval.fit_check import REPORTING_QLITE


SHARD_BYTES = 2 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    def config(self, layers: int | None = None) -> dict:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": self.vocab,
                "hidden_size": self.hidden, "intermediate_size": self.intermediate,
                "num_hidden_layers": layers or self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-06, "tie_word_embeddings": self.tied, "bos_token_id": 151643,
                "eos_token_id": 151645, "hidden_act": "silu", "torch_dtype": "bfloat16"}

    def tensors(self, layers: int | None = None):
        """(name, shape) of every tensor, in checkpoint order."""
        h, i, d = self.hidden, self.intermediate, self.hidden // self.heads
        yield "model.embed_tokens.weight", (self.vocab, h)
        for n in range(layers or self.layers):
            p = f"model.layers.{n}."
            yield p + "input_layernorm.weight", (h,)
            for proj, rows in (("q", self.heads * d), ("k", self.kv_heads * d), ("v", self.kv_heads * d)):
                yield p + f"self_attn.{proj}_proj.weight", (rows, h)
                yield p + f"self_attn.{proj}_proj.bias", (rows,)
            yield p + "self_attn.o_proj.weight", (h, h)
            yield p + "post_attention_layernorm.weight", (h,)
            yield p + "mlp.gate_proj.weight", (i, h)
            yield p + "mlp.up_proj.weight", (i, h)
            yield p + "mlp.down_proj.weight", (h, i)
        yield "model.norm.weight", (h,)
        if not self.tied:
            yield "lm_head.weight", (self.vocab, h)

    def parameters(self, layers: int | None = None) -> int:
        return sum(torch.Size(shape).numel() for _, shape in self.tensors(layers))


SHAPES = {  # Qwen2.5's published configs
    "0.5b": Shape(896, 4864, 24, 14, 2, 151936, True),
    "1.5b": Shape(1536, 8960, 28, 12, 2, 151936, True),
    "3b": Shape(2048, 11008, 36, 16, 2, 151936, True),
    "7b": Shape(3584, 18944, 28, 28, 4, 152064, False),
    "14b": Shape(5120, 13824, 48, 40, 8, 152064, False),
    "32b": Shape(5120, 27648, 64, 40, 8, 152064, False),
    "72b": Shape(8192, 29568, 80, 64, 8, 152064, False),
}


def random_tensor(name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1, biases and weights N(0, 0.02): activations stay in range through any depth."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)


def write_checkpoint(shape: Shape, out: Path, tokenizer_dir: Path, layers: int | None = None, seed: int = 0) -> Path:
    """A random-weight checkpoint of `shape` in out (made whole in a temporary directory beside it, then
    moved into place); shards of at most SHARD_BYTES."""
    if out.exists():
        raise click.ClickException(f"{out}: already exists")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    shards, shard, size = [], {}, 0

    def flush():
        nonlocal shard, size
        if shard:
            shards.append((f"model-{len(shards) + 1:05d}.safetensors", list(shard)))
            save_file(shard, str(tmp / shards[-1][0]), metadata={"format": "pt"})
            shard, size = {}, 0

    for name, dims in shape.tensors(layers):
        t = random_tensor(name, dims, gen)
        if size + t.numel() * 2 > SHARD_BYTES:
            flush()
        shard[name], size = t, size + t.numel() * 2
    flush()
    weight_map = {name: file for file, names in shards for name in names}
    index = {"metadata": {"total_size": 2 * shape.parameters(layers)}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (tmp / "config.json").write_text(json.dumps(shape.config(layers), indent=1))
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).exists():
            shutil.copyfile(tokenizer_dir / file, tmp / file)
    tmp.rename(out)
    return out


RECIPES = {  # name: qlite quantize flags
    "rtn": ["--bits", "4", "--group-size", "128", "--no-report"],
    "q4": ["--preset", "q4", "--no-report"],  # the default: --target-bpw 4.5 from measured sensitivities
    "gptq": ["--bits", "4", "--group-size", "128", "--method", "gptq", "--no-report"],
    "report": ["--bits", "4", "--group-size", "128"],  # rtn and the fidelity report: the report's cost is the difference
}


def timed_qlite(args: list[str]) -> tuple[float, int, str]:
    """Run `qlite ARGS` in a fresh process: (wall seconds, its own peak RSS in bytes as it reads it at exit
    (a child's ru_maxrss would count this process's RSS at the fork), the last line of its stderr if it
    failed, else '')."""
    t = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", REPORTING_QLITE, *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    seconds, err = time.perf_counter() - t, run.stderr
    if run.returncode:
        return seconds, 0, (err.strip().splitlines() or ["failed"])[-1]
    return seconds, int(err.rsplit("qlite-peak-rss ", 1)[1].split()[0]), ""


def quantize_row(shape: str, params: int, recipe: str, src: Path, extra: list[str]) -> dict:
    out = src.with_name(f"{src.name}-{recipe}")
    seconds, peak, failed = timed_qlite(["quantize", str(src), "-o", str(out), "--force", *RECIPES[recipe], *extra])
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) if not failed else 0
    return {"shape": shape, "params": params, "recipe": recipe, "seconds": seconds, "peak": peak,
            "size": size, "out": str(out), "error": failed}


def table(rows: list[dict]) -> str:
    lines = ["| shape | parameters | recipe | seconds | s per B params | peak RSS MiB | output MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['shape']} | {r['params'] / 1e9:.2f}B | {r['recipe']} | failed: {r['error']} | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['params'] / 1e9:.2f}B | {r['recipe']} | {r['seconds']:.1f} | "
                     f"{r['seconds'] / (r['params'] / 1e9):.1f} | {r['peak'] / 2**20:.0f} | {r['size'] / 2**20:.0f} |")
    return "\n".join(lines)


def bench_table(rows: list[dict]) -> str:
    lines = ["| shape | load s | prefill tok/s | decode tok/s | RSS above torch MiB |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | failed: {r['error']} | | | |")
            continue
        med = lambda key: sorted(run[key] for run in r["runs"])[len(r["runs"]) // 2]  # noqa: E731
        lines.append(f"| {r['shape']} | {r['load_s']:.2f} | {med('prefill_tps'):.1f} | {med('decode_tps'):.1f} | "
                     f"{r['rss_above_torch'] / 2**20:.0f} |")
    return "\n".join(lines)


@click.group()
def main():
    """Random-weight checkpoints of real Qwen2.5 shapes."""


@main.command()
@click.argument("shape", type=click.Choice(list(SHAPES)))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--layers", type=click.IntRange(min=1), help="only this many decoder layers (full width and vocabulary)")
@click.option("--tokenizer-from", type=click.Path(path_type=Path, file_okay=False),
              default=Path.home() / ".cache/qlite/qwen2.5-coder-0.5b-instruct", show_default=True)
def write(shape, out, layers, tokenizer_from):
    """Write a random-weight checkpoint of SHAPE into OUT."""
    if not (tokenizer_from / "tokenizer.json").exists():
        raise click.ClickException(f"{tokenizer_from}: no tokenizer.json (run `qlite fetch-demo` first)")
    s = SHAPES[shape]
    click.echo(f"{shape}: {s.parameters(layers) / 1e9:.2f}B parameters -> {write_checkpoint(s, out, tokenizer_from, layers)}")


@main.command()
@click.argument("shapes", nargs=-1, required=True, type=click.Choice(list(SHAPES)))
@click.option("--dir", "work", type=click.Path(path_type=Path, file_okay=False),
              default=Path.home() / ".cache/qlite/scale", show_default=True, help="where the checkpoints go")
@click.option("--layers", type=click.IntRange(min=1), help="only this many decoder layers per shape")
@click.option("--recipes", default="rtn", show_default=True, help=f"comma-separated: {', '.join(RECIPES)}")
@click.option("--quantize-args", default="", help="more qlite quantize flags for every recipe, e.g. '--nsamples 16'")
@click.option("--bench", is_flag=True, help="also time load, prefill and decode of the rtn checkpoint")
@click.option("--prompt-tokens", default=128, show_default=True)
@click.option("--new-tokens", default=16, show_default=True)
@click.option("--threads", default=os.cpu_count(), show_default=True)
@click.option("--tokenizer-from", type=click.Path(path_type=Path, file_okay=False),
              default=Path.home() / ".cache/qlite/qwen2.5-coder-0.5b-instruct", show_default=True)
@click.option("--markdown", "md_path", type=click.Path(path_type=Path), help="also write the tables here")
def measure(shapes, work, layers, recipes, quantize_args, bench, prompt_tokens, new_tokens, threads, tokenizer_from,
            md_path):
    """Quantize (and with --bench run) random-weight checkpoints of SHAPES; print the cost table."""
    from eval.bench import measure as bench_one
    recipes = [r for r in recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise click.ClickException(f"--recipes: unknown {', '.join(unknown)} (known: {', '.join(RECIPES)})")
    if bench and "rtn" not in recipes:
        raise click.ClickException("--bench times the rtn checkpoint: add rtn to --recipes")
    rows, runs = [], []
    for shape in shapes:
        src = work / (f"r{shape}" + (f"-{layers}l" if layers else ""))
        if not src.exists():
            write_checkpoint(SHAPES[shape], src, tokenizer_from, layers)
        params = SHAPES[shape].parameters(layers)
        for recipe in recipes:
            click.echo(f"{shape} {recipe}", err=True)
            rows.append(quantize_row(shape, params, recipe, src, quantize_args.split()))
            if bench and recipe == "rtn" and not rows[-1]["error"]:
                runs.append({"shape": shape, **bench_one({"engine": "qlite", "path": rows[-1]["out"], "threads": threads,
                                                         "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                                                         "repeats": 2})})
    text = table(rows) + ("\n\n" + bench_table(runs) if runs else "")
    click.echo(text)
    if md_path:
        md_path.write_text(text + "\n")


if __name__ == "__main__":
    main()
