"""The decoding kernels side by side, one process: for each demo-model shape and row count, qlite's
integer-activation product (native.gemv_vnni; int4's also prefill's), its bf16-activation product
(native.gemv_int4 / gemv_int8) and dequantize + bf16 matmul, interleaved call by call so that machine noise
hits all three alike. Random weights in the demo model's formats (int4-g128 decoder linears, int8 lm_head) and
in int4-g64 / -g32, int4k-g64 / -g32 and int8-g32 (layouts --target-bpw mixes in).
--steps DIR instead times greedy decode steps of a checkpoint: its layer modules called one by one
against the fused step (qlite/fused.py, one native call for all layers), alternating, one process.
--against SOURCE.c (with --shapes 7b: Qwen2.5-7B's) instead times the products of another version of this instruction set's kernel file
(built as qlite builds its own, with this checkout's headers) against the current ones, call by call
on the same weights, streamed from memory (copies of each weight, 300 MB in all), at each row count of --rows:
how a kernel change is measured (`git show REV:qlite/csrc/kernels.c > old.c`).
--verify DIR instead times speculative decoding's verify forward of a checkpoint (one exact forward of R
rows after a 64-token prompt, speculate.py) for each R of --rows, against a one-token step, interleaved,
through the fused layers and through the layer modules ("/ one step": over the fused one-token step).
--attention KEYS instead times one layer's decode attention at KEYS keys over a bf16, int8 and int4 KV cache.
--peak instead measures how close the integer-activation product for a few activation rows (speculation's verify,
a batched step) comes to this CPU's arithmetic: the rates of VNNI multiply-adds and float FMAs (alone and
interleaved; AVX2: vpmaddubsw alone and in the int4 product's mix, vpmaddwd in the int8 one's, eval/benchmarks/peak_rate.c)
on one core and on --threads threads at once (the bound: two vCPUs need not give twice one's), against the
product on weights that stay in L2 (int4-g128, 512 x 3584; AVX2 also int8, 256 x 3584).
--peak --steps DIR instead times a checkpoint's decode steps at 1 and --rows rows against the least time its
int4 and int8 products could take at those rows at the mixes' rates: how far faster products alone could
bring a batched step's time towards a one-row step's (the server's 8-client inter-token latency, issue 33);
--calls / 10 rounds (at least 2), the row counts interleaved.
--sampling instead times one sampled token over 151936 logits (the demo's vocabulary) with
Qwen2.5-Instruct's generation settings and with top-p alone: next_token (candidates first) against
the same filters over the whole vocabulary (HF transformers' way, and qlite's before), interleaved.

    python -m eval.benchmarks.kernel_bench [--rows 1,8,16] [--calls 30] [--threads 2] [--shapes 0.5b|7b]
                                [--attention KEYS | --sampling | --steps DIR | --verify DIR | --against FILE | --peak [--steps DIR]]
"""
from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

import click
import torch
import torch.nn.functional as F

from qlite import native
from qlite.formats import Int4, Int4K, Int8
from qlite.generate import SamplingParams, filter_min_p, filter_top_k, filter_top_p, next_token

SHAPES = [  # (name, format, N, K): the demo model's (Qwen2.5-0.5B) decoder linears and lm_head
    ("gate_up int4-g128", Int4(128), 9728, 896),
    ("down int4-g128", Int4(128), 896, 4864),
    ("gate_up int4-g64", Int4(64), 9728, 896),
    ("down int4-g64", Int4(64), 896, 4864),
    ("gate_up int4-g32", Int4(32), 9728, 896),  # no bf16-activation product: its steps are 64 weights
    ("down int4-g32", Int4(32), 896, 4864),
    ("gate_up int4k-g64", Int4K(64), 9728, 896),  # 8-bit scales under a row scale
    ("down int4k-g64", Int4K(64), 896, 4864),
    ("gate_up int4k-g32", Int4K(32), 9728, 896),
    ("down int4k-g32", Int4K(32), 896, 4864),
    ("gate_up int8-g32", Int8(32), 9728, 896),
    ("down int8-g32", Int8(32), 896, 4864),
    ("lm_head int8", Int8(None), 151936, 896),
]
SHAPES_7B = [  # Qwen2.5-7B's decoder linears (q|k|v and gate|up fused, as qlite runs them), int4-g128 and int8
    ("qkv int4-g128", Int4(128), 4608, 3584),
    ("o int4-g128", Int4(128), 3584, 3584),
    ("gate_up int4-g128", Int4(128), 37888, 3584),
    ("down int4-g128", Int4(128), 3584, 18944),
    ("gate_up int8", Int8(None), 37888, 3584),
    ("down int8", Int8(None), 3584, 18944),
]


NAMES = ("integer x (vnni)", "bf16 x", "dequantize + matmul")


def interleaved(funcs: dict, calls: int) -> dict[str, list[float]]:
    """Milliseconds of each function over `calls` rounds, called in turn within a round."""
    times = {k: [] for k in funcs}
    for _ in range(calls):
        for k, f in funcs.items():
            t = time.perf_counter()
            f()
            times[k].append(1e3 * (time.perf_counter() - t))
    return times


def cell(times: list[float]) -> str:
    return f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"


def contenders(stored, fmt) -> dict:
    """NAMES -> a function of x (M, K) for this weight, where the format has that kernel."""
    q, s, z, d = stored["qweight"], stored["scales"], stored.get("zeros"), stored.get("row_scales")
    tiled = native.tile_codes(q)  # the integer-activation products' layout, made once
    if z is None:
        funcs = (native.vnni_product(tiled, s, None), lambda x: native.gemv_int8(x, q, s, None),
                 lambda x: F.linear(x, native.dequantize_int8(q, s)))
    else:
        funcs = (native.vnni_product(tiled, s, z, None, d), lambda x: native.gemv_int4(x, q, s, z, None, d),
                 lambda x: F.linear(x, native.dequantize_int4(q, s, z, d)))
    out = dict(zip(NAMES, funcs))
    if isinstance(fmt, Int4) and fmt.group_size % 64:
        del out["bf16 x"]
    return out


SAMPLING = {  # the settings of Qwen2.5-*-Instruct's generation_config, and a common CLI choice
    "temperature 0.7, top-k 20, top-p 0.8": SamplingParams(temperature=0.7, top_p=0.8, top_k=20),
    "temperature 0.8, top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
}


def whole_vocabulary_token(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = filter_top_p(filter_top_k(logits / params.temperature, params.top_k), params.top_p)
    return torch.multinomial(filter_min_p(logits, params.min_p).softmax(-1), 1)[:, 0]


def time_attention(context: int, calls: int) -> None:
    """One decode step's attention for one layer of the demo model's shape (14 query heads over 2 kv
    heads of 64) at `context` keys, with a bf16, an int8 and an int4 cache, interleaved call by call."""
    from qlite import kv_quant

    n_head, n_kv, hd = 14, 2, 64
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, (n_head + 2 * n_kv) * hd, generator=gen).bfloat16()
    values = torch.randn(1, n_kv, context + 1, hd, generator=gen).bfloat16()
    caches = {"bf16": (16, values, values.clone())}
    caches.update({f"int{b}": (b, kv_quant.encode(values, b), kv_quant.encode(values, b)) for b in (8, 4)})
    cos, sin = torch.ones(1, hd), torch.zeros(1, hd)
    times = interleaved({name: lambda b=b, k=k, v=v: native.decode_attention(qkv, cos, sin, k, v, n_head, context, None, b)
                         for name, (b, k, v) in caches.items()}, calls)
    print(f"| KV cache | attention ms, 1 layer, {context} keys |")
    print("|---|---|")
    for name in caches:
        print(f"| {name} | {cell(times[name])} |")


def time_sampling(calls: int) -> None:
    """Synthetic logits shaped like a language model's: probability ~ rank^-1.5 over 151936 tokens
    (randomly placed), bf16-rounded as the model's logits are."""
    gen = torch.Generator().manual_seed(0)
    ranks = torch.randperm(151936, generator=gen).float() + 1
    logits = (-1.5 * ranks.log())[None].bfloat16().float()
    print("| settings | next_token ms | whole-vocabulary filters ms | ratio |")
    print("|---|---|---|---|")
    for name, params in SAMPLING.items():
        times = interleaved({"next_token": lambda: next_token(logits, params, None, None),
                             "whole": lambda: whole_vocabulary_token(logits, params)}, calls)
        ratio = statistics.median(times["whole"]) / statistics.median(times["next_token"])
        print(f"| {name} | {cell(times['next_token'])} | {cell(times['whole'])} | {ratio:.1f}x |")


def time_steps(model_dir, calls: int) -> None:
    """Rounds of 32 greedy decode steps after a 32-token prompt (`calls` rounds of each path, alternating):
    ms per step of the layer modules and of the fused step, whose logits must be the same bits."""
    from qlite.loader import load_model
    model = load_model(model_dir)
    fused = model.model.fused_layers
    if fused is None:
        raise click.ClickException(f"{model_dir}: no fused step here (a layer off the native kernels)")

    def steps(fused_layers, n: int = 32) -> tuple[float, torch.Tensor]:
        model.model.fused_layers = fused_layers
        cache, logits = model.new_cache(1, 32 + n), []
        with torch.inference_mode():
            out = model(torch.arange(100, 132)[None], cache, last_only=True)
            t = time.perf_counter()
            for _ in range(n):
                token = model.ops.argmax_rows(out[:, -1])[0][0]
                out = model(torch.tensor([[token]]), cache, last_only=True)
                logits.append(out[0, -1])
            return 1e3 * (time.perf_counter() - t) / n, torch.stack(logits)

    if not torch.equal(steps(None)[1], steps(fused)[1]):
        raise click.ClickException("the fused step's logits differ from the modules'")
    times = {"modules": [], "fused": []}
    for _ in range(calls):
        times["modules"].append(steps(None)[0])
        times["fused"].append(steps(fused)[0])
    ratio = statistics.median(times["modules"]) / statistics.median(times["fused"])
    print("| checkpoint | layer modules ms/step | fused step ms/step | modules / fused |")
    print("|---|---|---|---|")
    print(f"| {Path(model_dir).name} | {cell(times['modules'])} | {cell(times['fused'])} | {ratio:.2f} |")


def peak_rates(threads: int, avx2: bool = False) -> dict[str, tuple[float, float]]:
    """Instructions per ns (eval/benchmarks/peak_rate.c) of one core alone, and of `threads` threads running at once
    (their sum: two vCPUs may share a core or its host, so twice one core's rate is no bound): vpdpbusd zmm,
    vfmadd231ps zmm, the two 1:1, and vpdpwssd zmm on a broadcast memory operand (the int8 product's); or (avx2)
    vpmaddubsw ymm alone and in the int4 lanes product's mix (a vpbroadcastd per two, one for each of two blocks
    of weight rows, and a vpaddw each), and vpmaddwd in the int8 one's (likewise, with a vpaddd)."""
    import ctypes
    import tempfile
    import threading
    compiler = os.environ.get("CC") or "cc"
    with tempfile.TemporaryDirectory() as tmp:
        lib = ctypes.CDLL(str(native.build(compiler, Path(__file__).with_name("peak_rate.c"),
                                           ["-mavx512f", "-mavx512vnni"], Path(tmp))))
    lib.qlite_peak_rate.restype, lib.qlite_peak_rate.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long]
    kinds = {"vpmaddubsw": 3, "int4 mix": 4, "int8 mix": 5} if avx2 else \
        {"vpdpbusd": 0, "fma": 1, "vpdpbusd + fma": 2, "int8 mix": 6}
    lib.qlite_peak_rate(next(iter(kinds.values())), 2_000_000)  # the clock up

    def at_once(kind: int) -> float:  # ctypes lets go of the GIL: the threads run together
        rates = []
        team = [threading.Thread(target=lambda: rates.append(lib.qlite_peak_rate(kind, 4_000_000)))
                for _ in range(threads)]
        for t in team:
            t.start()
        for t in team:
            t.join()
        return sum(rates)

    return {name: (statistics.median(lib.qlite_peak_rate(kind, 4_000_000) for _ in range(5)),
                   statistics.median(at_once(kind) for _ in range(5)))
            for name, kind in kinds.items()}


def product_rate(fmt, N: int, K: int, M: int, calls: int) -> tuple[float, float]:
    """(ms per call, G multiply-adds/s) of the integer-activation product of fmt at M rows, weights in L2."""
    stored = fmt.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)))
    product = native.vnni_product(native.tile_codes(stored["qweight"]), stored["scales"], stored.get("zeros"), None)
    x = torch.randn(M, K).bfloat16()
    for _ in range(20):
        product(x)
    ms = statistics.median(interleaved({"p": lambda: [product(x) for _ in range(20)]}, calls)["p"]) / 20
    return ms, M * N * K / ms / 1e6


def mix_bounds(threads: int) -> tuple[dict, float, float, float]:
    """peak_rates for this CPU's kernels, and the G multiply-adds/s they allow with `threads` threads: pure
    vpdpbusd (AVX2: vpmaddubsw), the int4 product's mix and the int8 product's. int4 in lanes (csrc/lanes.h): a
    vpdpbusd per 16 weight rows and 4 inputs of an activation row, float work per group only, so pure vpdpbusd
    is its bound, and int8 in lanes a vpdpwssd per 16 rows and 2 inputs, its inputs a broadcast memory operand;
    on AVX2 a vpmaddubsw per 8 rows and 4 inputs, a broadcast of the inputs per two (two blocks of weight rows a
    pass) and an int16 add each: that mix's rate; and int8 in lanes a vpmaddwd per 8 rows and 2 inputs, likewise
    with an int32 add."""
    if not native.vnni_ready():
        raise click.ClickException("--peak measures the integer-activation kernels: this CPU has none")
    if native.isa() == "avxvnni":  # its mix (vpdpbusd ymm) has no peak_rate.c kernel
        raise click.ClickException("--peak measures the avx512 and avx2 kernels' mixes: QLITE_NATIVE_ISA=avx2 here")
    if native.isa() == "avx2":
        rates = peak_rates(threads, avx2=True)
        return rates, rates["vpmaddubsw"][1] * 32, rates["int4 mix"][1] * 32, rates["int8 mix"][1] * 16
    rates = peak_rates(threads)
    return rates, rates["vpdpbusd"][1] * 64, rates["vpdpbusd"][1] * 64, rates["int8 mix"][1] * 32


def time_peak(rows: list[int], calls: int, threads: int) -> None:
    """The integer-activation product's multiply-adds per second at each row count, weights in L2, against
    the rate this CPU's vector units allow the kernel's instruction mix (mix_bounds), measured with --threads
    threads at once."""
    rates, pure, per_core, int8_bound = mix_bounds(threads)
    team = f"{threads} thread{'s' if threads > 1 else ''} at once"
    if native.isa() == "avx2":
        (pure_1, _), (mix_1, mix), (words_1, words) = rates["vpmaddubsw"], rates["int4 mix"], rates["int8 mix"]
        print(f"one core: vpmaddubsw ymm {pure_1:.2f}/ns alone, {mix_1:.2f}/ns with a vpbroadcastd per two and a "
              f"vpaddw each (the int4 product's mix), vpmaddwd {words_1:.2f}/ns likewise with a vpaddd "
              f"(the int8 one's); {team}: {rates['vpmaddubsw'][1]:.2f}, {mix:.2f} and "
              f"{words:.2f}/ns ({mix / mix_1:.2f}x one core's mix): pure vpmaddubsw {pure:.0f} G multiply-adds/s, "
              f"the int4 product's mix at most {per_core:.0f}, the int8 product's at most {int8_bound:.0f}")
    else:
        (dp_1, dp), (fma_1, _), (both_1, _) = rates["vpdpbusd"], rates["fma"], rates["vpdpbusd + fma"]
        (words_1, words) = rates["int8 mix"]
        shared = both_1 < 0.75 * (dp_1 + fma_1)
        print(f"one core: vpdpbusd zmm {dp_1:.2f}/ns, vfmadd231ps zmm {fma_1:.2f}/ns, the two in turn "
              f"{both_1:.2f}/ns ({'shared' if shared else 'separate'} units), vpdpwssd zmm on a broadcast "
              f"{words_1:.2f}/ns; {team}: vpdpbusd {dp:.2f}/ns ({dp / dp_1:.2f}x one core's), vpdpwssd "
              f"{words:.2f}/ns: pure vpdpbusd {pure:.0f} G multiply-adds/s, the int4 product's mix at most "
              f"{per_core:.0f}, the int8 product's at most {int8_bound:.0f}")
    print("| rows | ms per call | G multiply-adds/s | of the mix's bound | of the pure multiply-adds' "
          "| int8 ms per call | int8 G multiply-adds/s | of its mix's bound |")
    print("|---|---|---|---|---|---|---|---|")
    for M in rows:
        ms, rate = product_rate(Int4(128), 512, 3584, M, calls)
        ms8, rate8 = product_rate(Int8(None), 256, 3584, M, calls)
        print(f"| {M} | {ms:.3f} | {rate:.0f} | {rate / per_core:.0%} | {rate / pure:.0%} | {ms8:.3f} | {rate8:.0f} "
              f"| {rate8 / int8_bound:.0%} |", flush=True)


def time_step_floor(model_dir, rows: list[int], calls: int, threads: int) -> None:
    """Decode steps of a checkpoint at 1 row and at each of `rows` (medians of 32 greedy steps after a 200-token
    prompt), and its quantized products alone at as many rows (every layer's kernel once, in the step's order, on
    random activations; medians of 5 passes), the row counts interleaved over `calls` rounds; against the least
    time those products could take: their multiply-adds at mix_bounds' rates. The step with its products at the
    bounds and the rest as measured (step less products) over the one-row step: the best ratio faster products
    alone could give. The products alone pay a Python call a layer that the fused step does not (at one row they
    can read above the step), so that ratio is if anything low."""
    from qlite.loader import load_model
    from qlite.qlinear import QuantLinear
    model = load_model(model_dir)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    macs = {"int4": 0, "int8": 0, "other": 0}  # per activation row
    for layer in layers:
        kind = layer.fmt.name[:4] if layer.fmt.name[:4] in ("int4", "int8") else "other"
        macs[kind] += layer.in_features * layer.out_features
    _, _, int4_bound, int8_bound = mix_bounds(threads)
    vocab, counts = model.config.vocab_size, sorted(set(rows) | {1})

    def step_ms(R: int, n: int = 32) -> float:
        cache, times = model.new_cache(R, 200 + n), []
        with torch.inference_mode():
            out = model((torch.arange(100, 300) % vocab).repeat(R, 1), cache, last_only=True)
            for _ in range(n):
                tokens = torch.tensor(model.ops.argmax_rows(out[:, -1])[0])[:, None]
                t = time.perf_counter()
                out = model(tokens, cache, last_only=True)
                times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times)

    def products_ms(R: int) -> float:
        xs = {K: torch.randn(R, K).bfloat16() for K in {layer.in_features for layer in layers}}
        times = []
        with torch.inference_mode():
            for _ in range(5):
                t = time.perf_counter()
                for layer in layers:
                    layer(xs[layer.in_features])
                times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times)

    steps, products = {R: [] for R in counts}, {R: [] for R in counts}
    for _ in range(calls):
        for R in counts:
            steps[R].append(step_ms(R))
            products[R].append(products_ms(R))
    one = statistics.median(steps[1])
    print(f"{Path(model_dir).name} on {native.isa()}, {threads} thread{'s' if threads > 1 else ''}: "
          f"{macs['int4'] / 1e6:.4g}M int4 and {macs['int8'] / 1e6:.4g}M int8 multiply-adds a row "
          f"({macs['other'] / 1e6:.4g}M in other layers, not counted), the mixes' bounds {int4_bound:.0f} / "
          f"{int8_bound:.0f} G multiply-adds/s")
    print("| rows | ms per step | / one row's | its products alone, ms | products at the bounds, ms | the step with "
          "them at the bounds, / one row's |")
    print("|---|---|---|---|---|---|")
    for R in counts:
        step, product = statistics.median(steps[R]), statistics.median(products[R])
        floor = R * (macs["int4"] / int4_bound + macs["int8"] / int8_bound) / 1e6
        best = f"{(step - product + floor) / one:.2f}" if R > 1 else "-"
        print(f"| {R} | {cell(steps[R])} | {step / one:.2f} | {cell(products[R])} | {floor:.3g} | {best} |", flush=True)


def time_verify(model_dir, rows: list[int], calls: int) -> None:
    """ms of one exact forward of R rows (R = 1: a plain step) after a 64-token prompt, the cache rolled
    back after each; `calls` rounds, the row counts interleaved, through the fused layers (one native call,
    fused.py) and through the layer modules (the verify pass's path before it took the fused one)."""
    from qlite.loader import load_model
    model = load_model(model_dir)
    rows, fused = sorted(set(rows) | {1}), model.model.fused_layers
    paths = {"fused": fused, "modules": None} if fused is not None else {"modules": None}
    times, vocab = {(p, r): [] for p in paths for r in rows}, model.config.vocab_size
    with torch.inference_mode():
        cache = model.new_cache(1, 64 + max(rows))
        model(torch.arange(1000, 1064)[None] % vocab, cache, last_only=True)
        for _ in range(calls):
            for path, layers in paths.items():
                model.model.fused_layers = layers
                for r in rows:
                    t = time.perf_counter()
                    model(torch.arange(2000, 2000 + r)[None] % vocab, cache, exact=r > 1)
                    times[path, r].append(1e3 * (time.perf_counter() - t))
                    cache.length -= r
    model.model.fused_layers = fused
    one = statistics.median(times[next(iter(paths)), 1])
    print(f"| checkpoint | rows | {' | '.join(f'{p} ms | / one step' for p in paths)} |")
    print("|---|---|" + "---|---|" * len(paths))
    for r in rows:
        cells = " | ".join(f"{cell(times[p, r])} | {statistics.median(times[p, r]) / one:.2f}" for p in paths)
        print(f"| {Path(model_dir).name} | {r} | {cells} |")


AGAINST = [  # (product, format, N, K): the products a decode step of the demo's checkpoints and mixes runs
    ("integer x", Int4(128), 9728, 896), ("integer x", Int4(128), 896, 4864), ("integer x", Int4(32), 9728, 896),
    ("integer x", Int4(64), 9728, 896), ("integer x", Int4K(32), 9728, 896), ("integer x", Int4K(64), 9728, 896),
    ("integer x", Int8(32), 9728, 896), ("integer x", Int8(None), 151936, 896),
    ("bf16 x", Int4(128), 9728, 896), ("bf16 x", Int8(None), 151936, 896), ("bf16 x", None, 9728, 896),
]


STREAM_BYTES = 300_000_000  # copies of each weight: more than any cache holds


def product_of(kind: str, fmt, stored: dict):
    if fmt is None:
        return native.bf16_product(stored["weight"], None)
    if kind == "integer x":
        return native.vnni_product(native.tile_codes(stored["qweight"]), stored["scales"], stored.get("zeros"), None, stored.get("row_scales"))
    if isinstance(fmt, Int4):
        return native.int4_product(stored["qweight"], stored["scales"], stored["zeros"], None, stored.get("row_scales"))
    return native.int8_product(stored["qweight"], stored["scales"], None)


AGAINST_7B = [("integer x", fmt, N, K) for _, fmt, N, K in SHAPES_7B] + [("integer x", Int8(None), 152064, 3584)]


def tile_with(lib, qweight: torch.Tensor) -> torch.Tensor:
    """native.tile_codes by another build of the kernels (lib)."""
    int4 = qweight.dtype == torch.uint8
    out = torch.empty_like(qweight)
    lib.qlite_tile_codes(qweight.data_ptr(), out.data_ptr(), qweight.shape[0], qweight.shape[1] * (2 if int4 else 1),
                         int(int4), torch.get_num_threads())
    return out


def time_against(source: Path, calls: int, shapes: str = "0.5b", rows: tuple[int, ...] = (1,)) -> None:
    import copy
    import shutil
    import tempfile

    name = native.isa()
    if native.library() is None:
        raise click.ClickException("no native kernels here")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    with tempfile.TemporaryDirectory() as tmp:
        flags = [*native.ISAS[name][2], "-I", str(native.CSRC)]
        try:
            other = native.load(native.build(compiler, source, flags, Path(tmp)), name)
        except subprocess.CalledProcessError as e:
            raise click.ClickException(f"{source}: does not compile ({e.stderr.decode().strip().splitlines()[-1]})")
    if other is None:
        raise click.ClickException(f"{source}: not a kernels file for {name}")
    print(f"| product ({name}) | weight | rows | current GB/s | {source.name} GB/s | current / {source.name} | same bits |")
    print("|---|---|---|---|---|---|---|")
    for kind, fmt, N, K in (AGAINST if shapes == "0.5b" else AGAINST_7B):
        if kind == "integer x" and not native.vnni_ready():
            continue  # AVX-512 without VNNI: no integer-activation products
        weight = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
        stored = {"weight": weight.bfloat16()} if fmt is None else fmt.quantize(weight)
        nbytes = sum(t.numel() * t.element_size() for t in stored.values())
        copies = [{k: t.clone() for k, t in stored.items()} for _ in range(max(2, STREAM_BYTES // nbytes))]
        current = [product_of(kind, fmt, c) for c in copies]
        against = [copy.copy(p) for p in current]
        for p, c in zip(against, copies):
            p.fn = getattr(other, p.fn_name)
            if kind == "integer x":  # codes tiled as the other file lays them out (its int4 layout may differ)
                p.buffers = (tile_with(other, c["qweight"]), *p.buffers[1:])
                p.args = (p.buffers[0].data_ptr(), *p.args[1:])
        for M in rows:
            x = torch.randn(M, K).bfloat16()
            same = torch.equal(current[0](x), against[0](x))
            times = interleaved({"current": lambda: [p(x) for p in current], "against": lambda: [p(x) for p in against]},
                                calls)
            speed = {k: [nbytes * len(copies) / (1e-3 * t) / 1e9 for t in v] for k, v in times.items()}
            ratio = statistics.median(speed["current"]) / statistics.median(speed["against"])
            print(f"| {kind} | {fmt.name if fmt else 'bf16'} {N}x{K} | {M} | {cell(speed['current'])} "
                  f"| {cell(speed['against'])} | {ratio:.2f} | {'yes' if same else 'no'} |", flush=True)


@click.command()
@click.option("--rows", default="1,8,16", show_default=True, help="activation rows (sequences in a step)")
@click.option("--calls", type=int, default=30, show_default=True, help="timed calls of each, interleaved")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--shapes", type=click.Choice(["0.5b", "7b"]), default="0.5b", show_default=True,
              help="the products' weight shapes: the demo model's, or Qwen2.5-7B's (prefill rows: --rows 128,512)")
@click.option("--attention", "attention_context", type=int,
              help="time one layer's decode attention at this many keys instead, bf16 / int8 / int4 KV cache")
@click.option("--sampling", is_flag=True, help="time one sampled token instead of the products")
@click.option("--peak", is_flag=True, help="the products at --rows rows on weights in L2 against the CPU's multiply-add "
                                           "rates instead; with --steps, that checkpoint's decode steps at 1 and --rows "
                                           "rows against its products' time at those rates")
@click.option("--steps", "steps_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="time decode steps of this checkpoint instead: layer modules against the fused step")
@click.option("--verify", "verify_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="time speculative decoding's verify forward of this checkpoint at --rows rows instead")
@click.option("--against", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="time the products of this version of the kernel file against the current ones instead (its "
              "headers come from its own directory first, then qlite's csrc: copy old headers beside it)")
def main(rows, calls, threads, shapes, attention_context, sampling, steps_dir, verify_dir, against, peak):
    torch.set_num_threads(threads)
    if attention_context:
        return time_attention(attention_context, calls)
    if sampling:
        return time_sampling(calls)
    if steps_dir and peak:
        return time_step_floor(steps_dir, [int(r) for r in rows.split(",")], max(2, calls // 10), threads)
    if steps_dir:
        return time_steps(steps_dir, calls)
    if peak:
        return time_peak([int(r) for r in rows.split(",")], calls, threads)
    if verify_dir:
        return time_verify(verify_dir, [int(r) for r in rows.split(",")], calls)
    if against:
        return time_against(against, calls, shapes, tuple(int(r) for r in rows.split(",")))
    if not native.vnni_ready():
        raise click.ClickException("the integer-activation kernels need AVX-512 VNNI and BF16, or AVX2 and FMA")
    print(f"| weight | rows | {' | '.join(f'{n} ms' for n in NAMES)} | bf16 x / integer x |")
    print("|---|---|---|---|---|---|---|")
    for name, fmt, N, K in (SHAPES if shapes == "0.5b" else SHAPES_7B):
        stored = fmt.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)))
        funcs = contenders(stored, fmt)
        for M in (int(r) for r in rows.split(",")):
            x = torch.randn(M, K).bfloat16()
            for f in funcs.values():
                f(x)  # warm up
            times = interleaved({k: lambda f=f: f(x) for k, f in funcs.items()},
                                calls if N < 100_000 else max(3, calls // 6))
            cells = [cell(times[k]) if k in times else "-" for k in NAMES]
            ratio = (f"{statistics.median(times['bf16 x']) / statistics.median(times['integer x (vnni)']):.2f}"
                     if "bf16 x" in times else "-")
            print(f"| {name} {N}x{K} | {M} | {' | '.join(cells)} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
