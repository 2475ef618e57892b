"""Checkpoints of real Qwen2.5 shapes (and of the mixtures of experts Qwen3-30B-A3B and Qwen2-57B-A14B) with random weights, for what the 0.5B demo model cannot show: cost
at 7B-72B (time, memory, prefill and decode speed). Every tensor of a real checkpoint, in bf16 safetensors
shards written one at a time (memory: one shard), the demo model's tokenizer beside them. For 32B and 72B
`--layers N` keeps a few layers at full width and vocabulary: the per-layer cost, which is what bounds a
streaming quantize.

    python -m eval.benchmarks.scale write 7b DIR [--layers N]
    python -m eval.benchmarks.scale measure 0.5b 7b [--recipes rtn,q4,gptq,report] [--bench] [--llama-cpp SRC]
                                         [--dir WORK] [--markdown PATH] [--plot PNG]

`measure` writes each shape's checkpoint under WORK (once), quantizes it with each recipe in a child process
(wall time, the child's peak RSS and peak anonymous memory), and with --bench times each checkpoint's load, prefill and decode
(eval.benchmarks.bench's runner, a fresh process). With --llama-cpp SRC (a llama.cpp source tree with its tools built
in SRC/build/bin, e.g. the one vendored in llama-cpp-python's sdist), the same checkpoint is converted by
llama.cpp's own convert_hf_to_gguf.py (f16) and llama-quantize (Q4_0, Q8_0), timed the same way, and with
--bench run in the same run. --plot draws seconds and peak RSS against parameters (matplotlib).

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


SHARD_BYTES = 2 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    model_type: str = "qwen2"
    head_dim: int | None = None  # None: hidden / heads
    experts: int = 0  # a mixture of experts: every layer sparse, `experts` of `expert_width`, `per_token` each token
    per_token: int = 0
    expert_width: int = 0
    shared_width: int = 0  # Qwen2-MoE's shared expert
    norm_topk_prob: bool = False

    def config(self, layers: int | None = None) -> dict:
        config = {"architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
                  "vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.intermediate,
                  "num_hidden_layers": layers or self.layers, "num_attention_heads": self.heads,
                  "num_key_value_heads": self.kv_heads, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                  "rms_norm_eps": 1e-06, "tie_word_embeddings": self.tied, "bos_token_id": 151643,
                  "eos_token_id": 151645, "hidden_act": "silu", "torch_dtype": "bfloat16"}
        if self.head_dim:
            config["head_dim"] = self.head_dim
        if self.experts:
            config.update(num_experts=self.experts, num_experts_per_tok=self.per_token,
                          moe_intermediate_size=self.expert_width, norm_topk_prob=self.norm_topk_prob)
            if self.shared_width:
                config["shared_expert_intermediate_size"] = self.shared_width
        return config

    def tensors(self, layers: int | None = None):
        """(name, shape) of every tensor, in checkpoint order."""
        h, d = self.hidden, self.head_dim or self.hidden // self.heads
        bias, qk_norm = self.model_type in ("qwen2", "qwen2_moe"), self.model_type == "qwen3_moe"
        yield "model.embed_tokens.weight", (self.vocab, h)
        for n in range(layers or self.layers):
            p = f"model.layers.{n}."
            yield p + "input_layernorm.weight", (h,)
            for proj, rows in (("q", self.heads * d), ("k", self.kv_heads * d), ("v", self.kv_heads * d)):
                yield p + f"self_attn.{proj}_proj.weight", (rows, h)
                if bias:
                    yield p + f"self_attn.{proj}_proj.bias", (rows,)
            yield p + "self_attn.o_proj.weight", (h, self.heads * d)
            if qk_norm:
                yield p + "self_attn.q_norm.weight", (d,)
                yield p + "self_attn.k_norm.weight", (d,)
            yield p + "post_attention_layernorm.weight", (h,)
            mlps = [("mlp.", self.intermediate)]
            if self.experts:
                yield p + "mlp.gate.weight", (self.experts, h)
                mlps = [(f"mlp.experts.{e}.", self.expert_width) for e in range(self.experts)]
                if self.shared_width:
                    mlps.append(("mlp.shared_expert.", self.shared_width))
                    yield p + "mlp.shared_expert_gate.weight", (1, h)
            for prefix, width in mlps:
                yield p + prefix + "gate_proj.weight", (width, h)
                yield p + prefix + "up_proj.weight", (width, h)
                yield p + prefix + "down_proj.weight", (h, width)
        yield "model.norm.weight", (h,)
        if not self.tied:
            yield "lm_head.weight", (self.vocab, h)

    def parameters(self, layers: int | None = None) -> int:
        return sum(torch.Size(shape).numel() for _, shape in self.tensors(layers))

    def active_parameters(self, layers: int | None = None) -> int:
        """Parameters one token reads (a mixture: its k experts of each layer's, not the others)."""
        unused = (self.experts - self.per_token) * 3 * self.hidden * self.expert_width * (layers or self.layers)
        return self.parameters(layers) - unused


SHAPES = {  # Qwen2.5's published configs
    "0.5b": Shape(896, 4864, 24, 14, 2, 151936, True),
    "1.5b": Shape(1536, 8960, 28, 12, 2, 151936, True),
    "3b": Shape(2048, 11008, 36, 16, 2, 151936, True),
    "7b": Shape(3584, 18944, 28, 28, 4, 152064, False),
    "14b": Shape(5120, 13824, 48, 40, 8, 152064, False),
    "32b": Shape(5120, 27648, 64, 40, 8, 152064, False),
    "72b": Shape(8192, 29568, 80, 64, 8, 152064, False),
    # mixtures of experts (Qwen3's and Qwen2's published configs)
    "30b-a3b": Shape(2048, 6144, 48, 32, 4, 151936, False, "qwen3_moe", head_dim=128, experts=128, per_token=8,
                     expert_width=768, norm_topk_prob=True),
    "57b-a14b": Shape(3584, 18944, 28, 28, 4, 151936, False, "qwen2_moe", experts=64, per_token=8, expert_width=2560,
                      shared_width=20480),
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


RECIPES = {  # name: qlite quantize flags (llama.cpp's rows: LLAMA_TYPES)
    "rtn": ["--bits", "4", "--group-size", "128", "--no-report"],
    "q4": ["--preset", "q4", "--no-report"],  # the default: --target-bpw 4.5 from measured sensitivities
    "gptq": ["--bits", "4", "--group-size", "128", "--method", "gptq", "--no-report"],
    "q4-gptq": ["--preset", "q4-gptq", "--no-report"],  # --target-bpw with GPTQ
    "report": ["--bits", "4", "--group-size", "128"],  # rtn and the fidelity report: the report's cost is the difference
}


LLAMA_TYPES = ("Q4_0", "Q8_0")  # llama-quantize's types, from the f16 GGUF its converter writes

# Runs a command and reports its peak RSS and peak anonymous RSS: a small Python between this process and the
# command, because a child's ru_maxrss counts the RSS of the process it was forked from (this one holds torch;
# the shim does not). Anonymous memory (what the process allocated, not the source's mapped pages, which the
# kernel can drop) is sampled from /proc every 20 ms: a shorter spike can be missed.
PEAK_RSS_SHIM = ("import resource, subprocess, sys, time\n"
                 "child, anon = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL), 0\n"
                 "while child.poll() is None:\n"
                 "    try:\n"
                 "        with open(f'/proc/{child.pid}/status') as f:\n"
                 "            anon = max([anon] + [int(l.split()[1]) * 1024 for l in f if l.startswith('RssAnon:')])\n"
                 "    except OSError:\n"
                 "        pass\n"
                 "    time.sleep(0.02)\n"
                 "sys.stderr.write(f'\\npeak-rss {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024} {anon}\\n')\n"
                 "sys.exit(child.returncode)")


def timed(argv: list[str], env: dict | None = None) -> tuple[float, int, int, str]:
    """Run argv in a fresh process: (wall seconds, its peak RSS and peak anonymous RSS in bytes, the last
    line of its stderr if it failed, else '')."""
    t = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", PEAK_RSS_SHIM, *argv], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    seconds, err = time.perf_counter() - t, run.stderr
    if run.returncode:
        return seconds, 0, 0, (err.rsplit("\npeak-rss", 1)[0].strip().splitlines() or ["failed"])[-1]
    peak, anon = err.rsplit("peak-rss ", 1)[1].split()[:2]
    return seconds, int(peak), int(anon), ""


def row(shape: str, params: int, recipe: str, out: Path, argv: list[str], env: dict | None = None) -> dict:
    seconds, peak, anon, failed = timed(argv, env)
    files = [out] if out.is_file() else list(out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files) if not failed else 0
    return {"shape": shape, "params": params, "recipe": recipe, "seconds": seconds, "peak": peak, "anon": anon,
            "size": size, "out": str(out), "error": failed}


def quantize_row(shape: str, params: int, recipe: str, src: Path, extra: list[str]) -> dict:
    out = src.with_name(f"{src.name}-{recipe}")
    return row(shape, params, recipe, out, [sys.executable, "-m", "qlite", "quantize", str(src), "-o", str(out),
                                            "--force", *RECIPES[recipe], *extra])


def llama_cpp_rows(shape: str, params: int, src: Path, llama: Path, threads: int) -> list[dict]:
    """llama.cpp's own conversion of src: f16 GGUF (its converter), then each of LLAMA_TYPES (its quantizer);
    the f16 file is deleted once quantized (15 GB at 7B)."""
    f16 = src.with_name(f"{src.name}-f16.gguf")
    rows = [row(shape, params, "llama.cpp convert f16", f16,
                [sys.executable, str(llama / "convert_hf_to_gguf.py"), str(src), "--outtype", "f16", "--outfile", str(f16)],
                {"PYTHONPATH": str(llama / "gguf-py")})]
    for kind in LLAMA_TYPES if not rows[0]["error"] else ():
        out = src.with_name(f"{src.name}-{kind.lower()}.gguf")
        rows.append(row(shape, params, f"llama.cpp {kind}", out,
                        [str(llama / "build/bin/llama-quantize"), str(f16), str(out), kind, str(threads)]))
    f16.unlink(missing_ok=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| shape | parameters | recipe | seconds | s per B params | peak RSS MiB | peak anonymous MiB | output MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['shape']} | {r['params'] / 1e9:.2f}B | {r['recipe']} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['params'] / 1e9:.2f}B | {r['recipe']} | {r['seconds']:.1f} | "
                     f"{r['seconds'] / (r['params'] / 1e9):.1f} | {r['peak'] / 2**20:.0f} | {r['anon'] / 2**20:.0f} | "
                     f"{r['size'] / 2**20:.0f} |")
    return "\n".join(lines)


def bench_table(rows: list[dict]) -> str:
    lines = ["| shape | model | load s | prefill tok/s | decode tok/s | RSS above the engine MiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['model']} | failed: {r['error']} | | | |")
            continue
        med = lambda key: sorted(run[key] for run in r["runs"])[len(r["runs"]) // 2]  # noqa: E731
        lines.append(f"| {r['shape']} | {r['model']} | {r['load_s']:.2f} | {med('prefill_tps'):.1f} | "
                     f"{med('decode_tps'):.1f} | {r['rss_above_torch'] / 2**20:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Seconds and peak RSS of each recipe against parameters, log-log."""
    try:
        import matplotlib
    except ImportError:
        raise click.ClickException("--plot: needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        done = [r for r in rows if r["recipe"] == recipe and not r["error"]]
        for ax, key, scale in ((axes[0], "seconds", 1), (axes[1], "peak", 2**-20)):
            ax.plot([r["params"] / 1e9 for r in done], [r[key] * scale for r in done], "o-", label=recipe)
    for ax, label in zip(axes, ("quantize wall seconds", "peak RSS, MiB")):
        ax.set(xscale="log", yscale="log", xlabel="parameters, billions", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
@click.option("--bench", is_flag=True, help="also time load, prefill and decode of each recipe's checkpoint (and llama.cpp's)")
@click.option("--llama-cpp", "llama", type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="llama.cpp source tree, tools built in build/bin: also convert with it, Q4_0 and Q8_0")
@click.option("--prompt-tokens", default=128, show_default=True)
@click.option("--new-tokens", default=16, show_default=True)
@click.option("--threads", default=os.cpu_count(), show_default=True)
@click.option("--tokenizer-from", type=click.Path(path_type=Path, file_okay=False),
              default=Path.home() / ".cache/qlite/qwen2.5-coder-0.5b-instruct", show_default=True)
@click.option("--markdown", "md_path", type=click.Path(path_type=Path), help="also write the tables here")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="also draw the cost table here (PNG)")
def measure(shapes, work, layers, recipes, quantize_args, bench, llama, prompt_tokens, new_tokens, threads,
            tokenizer_from, md_path, plot_path):
    """Quantize (and with --bench run) random-weight checkpoints of SHAPES; print the cost table."""
    from eval.benchmarks.bench import measure as bench_one
    recipes = [r for r in recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise click.ClickException(f"--recipes: unknown {', '.join(unknown)} (known: {', '.join(RECIPES)})")
    if llama and not all((llama / tool).exists() for tool in ("convert_hf_to_gguf.py", "build/bin/llama-quantize")):
        raise click.ClickException(f"--llama-cpp {llama}: needs convert_hf_to_gguf.py and build/bin/llama-quantize")
    rows, runs = [], []

    def run(model: str, spec: dict) -> None:
        runs.append({"shape": shape, "model": model, **bench_one({**spec, "threads": threads, "repeats": 2,
                                                                  "prompt_tokens": prompt_tokens,
                                                                  "new_tokens": new_tokens})})

    for shape in shapes:
        src = work / (f"r{shape}" + (f"-{layers}l" if layers else ""))
        if not src.exists():
            write_checkpoint(SHAPES[shape], src, tokenizer_from, layers)
        params = SHAPES[shape].parameters(layers)
        for recipe in recipes:
            click.echo(f"{shape} {recipe}", err=True)
            rows.append(quantize_row(shape, params, recipe, src, quantize_args.split()))
            if bench and recipe != "report" and not rows[-1]["error"]:  # report: rtn's checkpoint again
                run(f"qlite {recipe}", {"engine": "qlite", "path": rows[-1]["out"]})
        if llama:
            click.echo(f"{shape} llama.cpp", err=True)
            rows += llama_cpp_rows(shape, params, src, llama, threads)
            for r in rows[-len(LLAMA_TYPES):] if bench else ():
                if r["recipe"] != "llama.cpp convert f16" and not r["error"]:
                    run(r["recipe"], {"engine": "llama.cpp", "path": r["out"]})
    text = table(rows) + ("\n\n" + bench_table(runs) if runs else "")
    click.echo(text)
    if md_path:
        md_path.write_text(text + "\n")
    if plot_path:
        plot(rows, plot_path)


if __name__ == "__main__":
    main()
