"""Candidate grids below 4 bits, measured before a kernel is written for any of them (issue 56): each
candidate is a 16-bit checkpoint holding the source's weights as that candidate would round them (the
decoder's linears quantized and dequantized; embeddings and lm_head as they are), for `qlite eval` to
score beside the source and real quantized files.

A rotated candidate (NAME+rot) rounds W R instead of W, R = D H: random signs D (fixed seed) and the
orthonormal Hadamard transform H of each 128 inputs, and holds Q(W R) R^T. At run time the same product
is Q(W R) (x R)^T, the activations rotated by one fast transform per linear input (QuaRot, QuIP#): R
spreads a row's outliers over its 128 inputs, so fewer of them set a group's range.

    python -m eval.benchmarks.low_bit_candidates SRC OUT_DIR int3k-g32 int3k-g32+rot int2k-g16+rot
    qlite eval OUT_DIR/* --baseline SRC
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import click
import torch

from qlite.formats import format_named

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
BLOCK = 128  # inputs per Hadamard transform
SIGN_SEED = 56


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix [n, n] (n a power of 2), symmetric: its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n ** 0.5


def rotation() -> torch.Tensor:
    """R = D H for one BLOCK of inputs [BLOCK, BLOCK]: the same random signs D for every block and tensor."""
    signs = torch.randint(0, 2, (BLOCK,), generator=torch.Generator().manual_seed(SIGN_SEED)) * 2 - 1
    return signs[:, None].float() * hadamard(BLOCK)


def rounded(w: torch.Tensor, fmt, rotate: bool) -> torch.Tensor:
    """The weight [N, K] as the candidate holds it: Q(W) or Q(W R) R^T, float32."""
    N, K = w.shape
    w = w.float()
    if not rotate:
        return fmt.dequantize(fmt.quantize(w), K)
    r = rotation()
    turned = (w.reshape(N, K // BLOCK, BLOCK) @ r).reshape(N, K)  # W R, a block of inputs at a time
    back = fmt.dequantize(fmt.quantize(turned), K)
    return (back.reshape(N, K // BLOCK, BLOCK) @ r.t()).reshape(N, K)  # R^T: R is orthonormal


def write_candidate(src: Path, out: Path, name: str) -> Path:
    """out/NAME: the source with its decoder linears as candidate NAME (FORMAT or FORMAT+rot) holds them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    fmt, rotate = format_named(name.removesuffix("+rot")), name.endswith("+rot")
    dst, tmp = out / name, out / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for side in src.iterdir():
        if side.is_file() and side.suffix != ".safetensors":
            shutil.copy(side, tmp / side.name)
    for shard in sorted(src.glob("*.safetensors")):
        tensors = {}
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                tensors[key] = rounded(t, fmt, rotate).to(t.dtype) if LINEAR.fullmatch(key) else t
        save_file(tensors, tmp / shard.name, metadata={"format": "pt"})
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


@click.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.argument("candidates", nargs=-1, required=True)
def main(src: Path, out: Path, candidates: tuple[str, ...]):
    for name in candidates:
        click.echo(write_candidate(src, out, name))


if __name__ == "__main__":
    main()
