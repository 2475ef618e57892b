"""Speed and memory, side by side: qlite checkpoints and peers (transformers, llama.cpp through
llama-cpp-python when installed) on the same prompt, the same thread count, in one run.

Each measurement runs in a fresh process (clean load time and peak memory). Per model: load time,
prefill of a --prompt-tokens prompt (tokens/s and time to first token), greedy decode of --new-tokens
(tokens/s), resident memory above a bare `import torch`, peak RSS, size on disk. Medians over
--repeats runs, with min-max.

    python -m eval.benchmarks.bench DIR... [--transformers fp32,bf16] [--gguf FILE ...] [--markdown BENCHMARKS.md]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

def _prompt_ids(tokenize, n: int) -> list[int]:
    """A deterministic prompt of exactly n tokens: the eval code text, cut."""
    from qlite.texts import load_text
    ids = tokenize(load_text("code"))
    return ids[:n]


def _mem() -> tuple[int, int]:
    """Resident memory now: all of it, and the anonymous part (not pages of mapped files)."""
    from qlite.memory import anon_rss_bytes, rss_bytes
    return rss_bytes(), anon_rss_bytes()


def _result(load_s: float, runs: list[dict], before: tuple[int, int]) -> dict:
    from qlite.memory import peak_rss_bytes
    rss, anon = _mem()
    return {"load_s": load_s, "runs": runs, "rss_above_torch": rss - before[0], "anon_above_torch": anon - before[1],
            "peak_rss": peak_rss_bytes()}


def run_qlite(spec: dict) -> dict:
    import torch
    from qlite.decode import Sequence, Shaping, decode_batch, generate_tokens
    from qlite.generate import SamplingParams
    from qlite.pipeline import load

    torch.set_num_threads(spec["threads"])
    before = _mem()
    t = time.perf_counter()
    lm = load(spec["path"], dtype=spec.get("dtype", "auto"), kernel=spec.get("kernel", "auto"),
              kv_cache=spec.get("kv_cache", "bf16"))
    load_s = time.perf_counter() - t
    prompt = _prompt_ids(lm.tokenizer.encode, spec["prompt_tokens"])
    runs = []
    grammar = None
    if spec.get("json_schema"):  # decoding under a grammar: what the mask costs a step
        from qlite.constrain import json_schema_grammar
        grammar = json_schema_grammar(json.loads(Path(spec["json_schema"]).read_text()))
        lm.constraint(grammar)  # llguidance's view of the tokenizer, built once (about a second), not timed
    for _ in range(spec["repeats"]):
        params = SamplingParams(max_new_tokens=spec["new_tokens"])
        t0 = time.perf_counter()
        if grammar is None:
            it = generate_tokens(lm.model, [prompt], params, eos_ids=())
        else:
            seq = Sequence(prompt, params, (), None, lm.model.device, lm.model.config.vocab_size,
                           Shaping(constraint=lm.constraint(grammar)))
            it = (token for [(token, _)] in decode_batch(lm.model, [prompt], [seq]))
        next(it)
        ttft = time.perf_counter() - t0
        n = sum(1 for _ in it)
        decode_s = time.perf_counter() - t0 - ttft
        runs.append({"ttft_s": ttft, "prefill_tps": len(prompt) / ttft, "decode_tps": n / decode_s})
    return _result(load_s, runs, before)


def run_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(spec["threads"])
    before = _mem()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["path"], dtype=dtype, attn_implementation="eager").eval()
    load_s = time.perf_counter() - t
    tok = AutoTokenizer.from_pretrained(spec["path"])
    prompt = torch.tensor([_prompt_ids(lambda s: tok.encode(s, add_special_tokens=False), spec["prompt_tokens"])])
    runs = []
    with torch.inference_mode():
        for _ in range(spec["repeats"]):
            kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kw)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens=spec["new_tokens"], min_new_tokens=spec["new_tokens"], **kw)
            total = time.perf_counter() - t0
            runs.append({"ttft_s": ttft, "prefill_tps": prompt.shape[1] / ttft,
                         "decode_tps": (spec["new_tokens"] - 1) / max(total - ttft, 1e-9)})
    return _result(load_s, runs, before)


def run_llama_cpp(spec: dict) -> dict:
    import torch  # noqa: F401  (the same baseline as the others: RSS above a bare import torch)
    from llama_cpp import Llama

    before = _mem()
    t = time.perf_counter()
    llm = Llama(model_path=spec["path"], n_ctx=spec["prompt_tokens"] + spec["new_tokens"] + 8,
                n_threads=spec["threads"], n_threads_batch=spec["threads"], n_batch=512, verbose=False)
    load_s = time.perf_counter() - t
    prompt = _prompt_ids(lambda s: llm.tokenize(s.encode(), add_bos=False, special=False), spec["prompt_tokens"])
    runs = []
    for _ in range(spec["repeats"]):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = llm.sample(temp=0.0)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(spec["new_tokens"] - 1):
            llm.eval([tok])
            tok = llm.sample(temp=0.0)
        decode_s = time.perf_counter() - t0
        runs.append({"ttft_s": ttft, "prefill_tps": len(prompt) / ttft,
                     "decode_tps": (spec["new_tokens"] - 1) / decode_s})
    return _result(load_s, runs, before)


RUNNERS = {"qlite": run_qlite, "transformers": run_transformers, "llama.cpp": run_llama_cpp}

# qlite's AVX2 kernels, and torch's own kernels (aten's vectorized ops, oneDNN's matmuls) limited to AVX2
AVX2_TORCH_ENV = {"QLITE_NATIVE_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def kernel_variants(model_dirs: list[Path], kernels: str, common: dict) -> list[tuple[str, dict]]:
    """Each qlite dir again with each named --kernel backend ("native-a16,aten")."""
    return [(f"{d.name} {kernel}", {"engine": "qlite", "path": str(d), "kernel": kernel, **common})
            for kernel in filter(None, kernels.split(",")) for d in model_dirs]


def kv_cache_variants(model_dirs: list[Path], kinds: str, common: dict) -> list[tuple[str, dict]]:
    """Each qlite dir again with each named --kv-cache kind ("int8,int4")."""
    return [(f"{d.name} kv {kind}", {"engine": "qlite", "path": str(d), "kv_cache": kind, **common})
            for kind in filter(None, kinds.split(",")) for d in model_dirs]


def avx2_variants(jobs: list[tuple[str, dict]], llama_lib: Path) -> list[tuple[str, dict]]:
    """Each qlite job (on its native kernels) and llama.cpp job again, as on an AVX2 CPU: qlite with
    AVX2_TORCH_ENV, llama.cpp with the libraries in llama_lib (LLAMA_CPP_LIB_PATH)."""
    env = {"qlite": AVX2_TORCH_ENV, "llama.cpp": {"LLAMA_CPP_LIB_PATH": str(llama_lib.resolve())}}
    return [(f"{label} avx2", {**spec, "env": {**spec.get("env", {}), **env[spec["engine"]]}})
            for label, spec in jobs if spec["engine"] in env and "QLITE_NATIVE" not in spec.get("env", {})]


LLAMA_FTYPES = {"f16": 1, "q8_0": 7, "q4_0": 2}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers


def llama_cpp_variants(src_gguf: Path, out_dir: Path, types=("f16", "q8_0", "q4_0")) -> list[Path]:
    """GGUFs of the given types made from src_gguf with llama.cpp's own quantizer (requantizing the
    demo's mixed types: speed depends on the type, not the values). Cached by file name."""
    import ctypes

    import llama_cpp

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for t in types:
        dst = out_dir / f"{src_gguf.stem}-{t}.gguf"
        if not dst.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = LLAMA_FTYPES[t]
            params.allow_requantize = True
            params.nthread = os.cpu_count()
            tmp = dst.with_suffix(".part")
            rc = llama_cpp.llama_model_quantize(str(src_gguf).encode(), str(tmp).encode(), ctypes.byref(params))
            if rc != 0:
                raise RuntimeError(f"llama_model_quantize to {t} failed ({rc})")
            os.replace(tmp, dst)
        paths.append(dst)
    return paths


def measure(spec: dict) -> dict:
    """Run one spec in a fresh process; returns its figures (or an error)."""
    r = subprocess.run([sys.executable, "-m", "eval.benchmarks.bench", "--child", json.dumps(spec)],
                       capture_output=True, text=True, env={**os.environ, **spec.get("env", {})})
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def pool(results: list[dict]) -> dict:
    """One job's results from several rounds (each a fresh process) as one: every run's figures, the
    median load time, the largest memory figures; the first error if any round failed."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    return {"load_s": statistics.median(r["load_s"] for r in results), "runs": [run for r in results for run in r["runs"]],
            **{k: max(r[k] for r in results) for k in ("rss_above_torch", "anon_above_torch", "peak_rss")}}


def interleaved(jobs: list, rounds: int) -> list:
    """The order to run jobs in over several rounds: forward, then backward, and so on, so that a drift
    of the machine's speed during the run falls on every job alike."""
    return [job for r in range(rounds) for job in (jobs if r % 2 == 0 else jobs[::-1])]


def decode_bytes(spec: dict) -> int:
    """Weight bytes one decode step reads: every tensor but the embedding (one row of it is read)
    unless the head is the embedding table itself (tied, no head of its own), at the dtype the engine
    runs them in; a mixture's experts by the share of them a token chooses (k of E: uniform routing)."""
    path = Path(spec["path"])
    if spec["engine"] == "llama.cpp":
        from gguf import GGUFReader
        reader = GGUFReader(path)
        field = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
        arch = field("general.architecture")
        used, count = field(f"{arch}.expert_used_count"), field(f"{arch}.expert_count")
        share = used / count if used and count else 1.0
        own_head = any(t.name == "output.weight" for t in reader.tensors)
        return round(sum(int(t.n_bytes) * (share if "_exps." in t.name else 1.0) for t in reader.tensors
                         if t.name != "token_embd.weight" or not own_head))
    from qlite.checkpoint import CheckpointDir
    ckpt = CheckpointDir(path)
    own_head = any(n.startswith("lm_head.") for n in ckpt.tensors) or not ckpt.config.tie_word_embeddings
    run_fp32 = spec.get("dtype") in ("float32", "fp32")
    experts = ckpt.config.experts
    share = 1.0 if experts is None else experts.per_token / experts.count
    total = 0.0
    for name, t in ckpt.tensors.items():
        if name.startswith("model.embed_tokens.") and own_head:
            continue
        total += t.nbytes * (2 if run_fp32 and t.dtype in ("F16", "BF16") else 1) * (share if ".mlp.experts." in name else 1.0)
    return round(total)


def size_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def streaming_read_gbs(threads: int, gib: int = 1, reads: int = 5) -> list[float]:
    """This machine's plain streaming read: GB/s of torch summing a float32 tensor of `gib` GiB (far past
    any cache) on `threads` threads, `reads` times: the rate a decode step's weight stream is held to."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(gib * 2**28, dtype=torch.float32)
    data.sum()  # pages in
    out = []
    for _ in range(reads):
        start = time.perf_counter()
        data.sum()
        out.append(gib * 2**30 / (time.perf_counter() - start) / 1e9)
    return out


def summarize(label: str, spec: dict, result: dict, bandwidth: float) -> dict:
    cap = bandwidth / decode_bytes(spec)
    row = {"name": label, "engine": spec["engine"], "size_mib": size_on_disk(Path(spec["path"])) / 2**20, "cap": cap,
           "step_gb": decode_bytes(spec) / 1e9}
    if "error" in result:
        return {**row, "error": result["error"]}
    for key in ("prefill_tps", "decode_tps", "ttft_s"):
        values = [r[key] for r in result["runs"]]
        row[key] = (statistics.median(values), min(values), max(values))
    row.update(load_s=result["load_s"], rss_mib=result["rss_above_torch"] / 2**20,
               anon_mib=result["anon_above_torch"] / 2**20, peak_mib=result["peak_rss"] / 2**20)
    return row


def markdown(rows: list[dict], header: str, pairs: list[tuple[str, str]], bandwidth: float) -> str:
    lines = [header, "", "| model | engine | decode tok/s | GB read per token | share of cap | prefill tok/s | TTFT s "
             "| load s | RSS above torch MiB (anonymous) | peak RSS MiB | size MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['engine']} | failed: {r['error']} | | | | | | | | |")
            continue
        f = lambda k, p=1: f"{r[k][0]:.{p}f} ({r[k][1]:.{p}f}-{r[k][2]:.{p}f})"
        lines.append(f"| {r['name']} | {r['engine']} | {f('decode_tps')} | {r['step_gb']:.2f} | {r['decode_tps'][0] / r['cap']:.0%} of "
                     f"{r['cap']:.0f} | {f('prefill_tps')} | {f('ttft_s', 2)} | {r['load_s']:.2f} | {r['rss_mib']:.0f} "
                     f"({r['anon_mib']:.0f}) | {r['peak_mib']:.0f} | {r['size_mib']:.0f} |")
    lines += ["", f"Cap: {bandwidth / 1e9:.1f} GB/s of memory bandwidth over the weight bytes one decode step reads "
              "(all but the embedding, at the dtype the engine runs). Resident memory is measured after the "
              "runs, above a bare `import torch` in the same process (the tokenizer included); in brackets the "
              "anonymous part, the rest being pages of mapped files (shared with every process that maps them). "
              "Load time: from the call to a model ready to run, tokenizer included."]
    by_name = {r["name"]: r for r in rows if "error" not in r}
    if pairs:
        lines += ["", "| ratio (median decode, median prefill) | decode | prefill |", "|---|---|---|"]
        for a, b in pairs:
            if a in by_name and b in by_name:
                ra, rb = by_name[a], by_name[b]
                lines.append(f"| {a} / {b} | {ra['decode_tps'][0] / rb['decode_tps'][0]:.2f} "
                             f"| {ra['prefill_tps'][0] / rb['prefill_tps'][0]:.2f} |")
    return "\n".join(lines)


@click.command()
@click.argument("model_dirs", nargs=-1, type=click.Path(path_type=Path))
@click.option("--transformers", "hf", default="", help="also run transformers on the first dir: fp32,bf16")
@click.option("--fp32", is_flag=True, help="also run qlite on the first dir in float32")
@click.option("--kernels", default="", help="also run each dir with these --kernel backends: native-a16,aten")
@click.option("--kv-caches", default="", help="also run each dir with these --kv-cache kinds: int8,int4")
@click.option("--torch-kernels", is_flag=True, help="also run each dir with QLITE_NATIVE=0 (torch's own kernels)")
@click.option("--json-schema", type=click.Path(path_type=Path, dir_okay=False),
              help="also run each dir decoding under this JSON schema (constrained decoding's cost)")
@click.option("--avx2", "avx2_lib", type=click.Path(path_type=Path, file_okay=False),
              help="also run every qlite and llama.cpp model as on an AVX2 CPU: qlite with its AVX2 kernels and "
                   "torch limited to AVX2, llama.cpp with the libraries in this dir (llama-cpp-python built with "
                   "-DGGML_NATIVE=OFF -DGGML_AVX512=OFF)")
@click.option("--gguf", multiple=True, type=click.Path(path_type=Path), help="also run llama.cpp on this GGUF")
@click.option("--llama-cpp-from", type=click.Path(path_type=Path),
              help="make f16, Q8_0 and Q4_0 GGUFs from this GGUF (cached beside it) and run llama.cpp on each")
@click.option("--prompt-tokens", default=512, show_default=True)
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--repeats", default=3, show_default=True, help="runs per process")
@click.option("--rounds", default=1, show_default=True,
              help="processes per job, interleaved with the other jobs' (forward, then backward); figures pool every run")
@click.option("--threads", default=os.cpu_count(), show_default=True)
@click.option("--markdown", "md_path", type=click.Path(path_type=Path), help="write the table here")
@click.option("--pair", "pairs", multiple=True, help="NAME_A=NAME_B: print A's speed over B's (repeatable)")
@click.option("--bandwidth-gbs", type=float, help="memory bandwidth for the decode cap [default: the median of a plain "
              "streaming read measured 3 times before each job]")
@click.option("--json", "json_path", type=click.Path(path_type=Path))
@click.option("--child", hidden=True)
def main(model_dirs, hf, fp32, kernels, kv_caches, torch_kernels, json_schema, avx2_lib, gguf, llama_cpp_from, prompt_tokens, new_tokens, repeats, rounds,
         threads, md_path, pairs, bandwidth_gbs, json_path, child):
    if child:
        spec = json.loads(child)
        print(json.dumps(RUNNERS[spec["engine"]](spec)))
        return
    common = dict(prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats, threads=threads)
    jobs = [(d.name, {"engine": "qlite", "path": str(d), **common}) for d in model_dirs]
    if fp32:
        jobs.insert(1, (f"{model_dirs[0].name} fp32", {"engine": "qlite", "path": str(model_dirs[0]),
                                                        "dtype": "float32", **common}))
    jobs += kernel_variants(model_dirs, kernels, common)
    jobs += kv_cache_variants(model_dirs, kv_caches, common)
    if json_schema:
        jobs += [(f"{d.name} json-schema", {"engine": "qlite", "path": str(d), "json_schema": str(json_schema.resolve()),
                                            **common}) for d in model_dirs]
    if torch_kernels:
        jobs += [(f"{d.name} torch-kernels",
                  {"engine": "qlite", "path": str(d), "env": {"QLITE_NATIVE": "0"}, **common}) for d in model_dirs]
    for dt in filter(None, hf.split(",")):
        jobs.append((f"{model_dirs[0].name} {dt}", {"engine": "transformers", "path": str(model_dirs[0]),
                                                     "dtype": dt, **common}))
    if llama_cpp_from:
        gguf = (*gguf, *llama_cpp_variants(llama_cpp_from, llama_cpp_from.parent / "llama-cpp"))
    jobs += [(g.name, {"engine": "llama.cpp", "path": str(g), **common}) for g in gguf]
    if avx2_lib:
        jobs += avx2_variants(jobs, avx2_lib)
    results = {label: [] for label, _ in jobs}
    reads = []  # this machine's bandwidth moves (28-60 GB/s over one session here): read beside every job
    for label, spec in interleaved(jobs, rounds):
        reads += [] if bandwidth_gbs else streaming_read_gbs(threads, reads=3)
        click.echo(f"bench {label} ({spec['engine']})", err=True)
        results[label].append(measure(spec))
    bandwidth_gbs = bandwidth_gbs or statistics.median(reads)
    rows = [summarize(label, spec, pool(results[label]), bandwidth_gbs * 1e9) for label, spec in jobs]
    runs = f"{repeats} runs" if rounds == 1 else f"{rounds} x {repeats} runs (rounds interleaved, each a fresh process)"
    read = f"; a plain streaming read {bandwidth_gbs:.1f} GB/s ({min(reads):.1f}-{max(reads):.1f})" if reads else ""
    header = (f"{threads} threads, prompt {prompt_tokens} tokens, {new_tokens} new tokens greedy, "
              f"median (min-max) of {runs}{read}, {time.strftime('%Y-%m-%d')}")
    table = markdown(rows, header, [tuple(p.split("=", 1)) for p in pairs], bandwidth_gbs * 1e9)
    click.echo(table)
    if md_path:
        md_path.write_text(table + "\n")
    if json_path:
        json_path.write_text(json.dumps({"header": header, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
