"""The low-bit products against int4-g128's at Qwen2.5-7B's decode shapes: one activation row, random weights,
copies of each weight past the caches (COPY_BYTES each), call by call interleaved so that machine noise hits all
alike. int4-g128 runs its decode product (integer activations, codes tiled in lanes); int3k / int2k their
bf16-activation products (csrc/lowbit.h) and, where the CPU has them (native.vnni_ready), their
integer-activation products in lanes ("lanes" rows). Prints a markdown table: ms, GB/s of stored bytes, time over
int4-g128's.

    python -m eval.benchmarks.low_bit_products [CALLS]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from qlite import native
from qlite.formats import Int2K, Int3K, Int4

SHAPES = [(2 * 18944, 3584), (3584, 18944), (4608, 3584)]  # gate|up, down, q|k|v
FORMATS = {"int4-g128": Int4(128, False), "int3k-g32": Int3K(32), "int3k-g16": Int3K(16), "int2k-g16": Int2K(16)}
COPY_BYTES = 0.5e9  # past the largest L3 seen (260 MiB); 7 formats x 3 shapes stay under 11 GB


def product(name: str, stored: dict):
    if name.startswith("int4"):
        return native.vnni_product(native.tile_codes(stored["qweight"]), stored["scales"], stored["zeros"])
    fmt = FORMATS[name.removesuffix(" lanes")]
    if name.endswith(" lanes"):
        codes, scale_bytes = native.tile_lowbit(stored["qweight"], stored["scales"])
        return native.vnni_lowbit_product(codes, scale_bytes, stored["row_scales"], fmt.bits)
    return native.lowbit_product(stored["qweight"], stored["scales"], stored["row_scales"], fmt.bits)


def names() -> list[str]:
    lanes = [f"{name} lanes" for name in FORMATS if not name.startswith("int4")] if native.vnni_ready() else []
    return [*FORMATS, *lanes]


def main(calls: int = 30) -> None:
    torch.manual_seed(0)
    products = {}
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        for name in names():
            stored = FORMATS[name.removesuffix(" lanes")].quantize(w)
            nbytes = sum(t.numel() * t.element_size() for t in stored.values())
            copies = [product(name, {key: t.clone() for key, t in stored.items()}) for _ in range(max(1, int(COPY_BYTES // nbytes)))]
            products[n, k, name] = copies, nbytes
    x = {k: torch.randn(1, k).bfloat16() for _, k in SHAPES}
    times = {key: [] for key in products}
    for call in range(calls):
        for key, (copies, _) in products.items():
            start = time.perf_counter()
            copies[call % len(copies)](x[key[1]])
            times[key].append(time.perf_counter() - start)
    print("| shape N x K | format | MB | ms median (min-max) | GB/s | time / int4-g128's |\n|---|---|---|---|---|---|")
    for (n, k, name), ts in times.items():
        med, base = statistics.median(ts), statistics.median(times[n, k, "int4-g128"])
        print(f"| {n} x {k} | {name} | {products[n, k, name][1] / 1e6:.1f} | {1e3 * med:.3f} ({1e3 * min(ts):.3f}-"
              f"{1e3 * max(ts):.3f}) | {products[n, k, name][1] / med / 1e9:.1f} | {med / base:.2f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
