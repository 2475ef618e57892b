"""Candidate grids below 4 bits, measured before a kernel is written for any of them (issue 56): each
candidate is a 16-bit checkpoint holding the source's weights as that candidate would round them (the
decoder's linears quantized and dequantized; embeddings and lm_head as they are), for `qlite eval` to
score beside the source and real quantized files.

A rotated candidate (NAME+rot) rounds W R instead of W, R = D H: random signs D (fixed) and the
orthonormal Hadamard transform H of each 128 inputs, and holds Q(W R) R^T. At run time the same product
is Q(W R) (x R)^T, the activations rotated by one fast transform per linear input (QuaRot, QuIP#): R
spreads a row's outliers over its 128 inputs, so fewer of them set a group's range.

With --gptq the rounding is GPTQ's, as `--preset q3` runs it (quantize/calibrate.py: layer by layer on the
quantized layers' outputs, GPTQ_CALIBRATION's windows and settings); a rotated candidate's GPTQ rounds W R
against the rotated inputs' Hessian R^T H R. OUT_DIR/NAME+gptq, lm_head 16-bit as well.

    python -m eval.benchmarks.low_bit_candidates SRC OUT_DIR int3k-g32 int3k-g32+rot int2k-g16+rot [--gptq]
    qlite eval OUT_DIR/* --baseline SRC
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import click
import torch

from qlite.formats import format_named, hadamard, turn_signs

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
BLOCK = 128  # inputs per Hadamard transform


def rotation() -> torch.Tensor:
    """R = D H for one BLOCK of inputs [BLOCK, BLOCK]: the rotated formats' (qlite.formats.Rotated: int4h, int3h),
    whose signs D are those this module's seed 56 drew when it measured them."""
    return turn_signs()[:, None] * hadamard(BLOCK)


def turn(w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """w [N, K] with each BLOCK of its inputs times r [BLOCK, BLOCK]: W R."""
    N, K = w.shape
    return (w.reshape(N, K // BLOCK, BLOCK) @ r).reshape(N, K)


def rounded(w: torch.Tensor, fmt, rotate: bool) -> torch.Tensor:
    """The weight [N, K] as the candidate holds it: Q(W) or Q(W R) R^T (R orthonormal), float32."""
    w, K = w.float(), w.shape[1]
    if not rotate:
        return fmt.dequantize(fmt.quantize(w), K)
    r = rotation()
    return turn(fmt.dequantize(fmt.quantize(turn(w, r)), K), r.t())


def rotated_hessian(hessian: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """R^T H R [K, K]: the Hessian X^T X of the rotated inputs X R."""
    return turn(turn(hessian.float(), r).t().contiguous(), r).t()


def gptq_rounded(src: Path, fmt, rotate: bool, calibration: dict | None = None) -> dict[str, torch.Tensor]:
    """Every decoder linear's weight as GPTQ leaves it, by module name (float32): Q(W), or Q(W R) R^T with GPTQ
    on (W R, R^T H R). calibrated_weights runs the layers and puts each rounded weight back; its GPTQ call is
    swapped for the rotated one, and its "format" takes back the weight that call returns. calibration:
    calibrated_convert's settings (GPTQ_CALIBRATION, q3's)."""
    from unittest import mock

    import quantize.calibrate as calibrate
    from qlite.checkpoint import CheckpointDir
    from quantize.gptq import gptq_linear
    from quantize.presets import GPTQ_CALIBRATION

    r = rotation() if rotate else torch.eye(BLOCK)

    class Held:  # the "stored tensors" are the rounded weight itself
        def dequantize(self, stored, in_features):
            return stored["w"]

    class DecoderOnly:  # the qconfig: every decoder linear, lm_head left 16-bit
        def format_for(self, module):
            return None if module == "lm_head" else Held()

    def gptq(weight, hessian, held, damp, act_order):
        stored = gptq_linear(turn(weight.float(), r), rotated_hessian(hessian, r), fmt, damp=damp, act_order=act_order)
        return {"w": turn(fmt.dequantize(stored, weight.shape[1]), r.t())}

    c = calibration or GPTQ_CALIBRATION
    with mock.patch.object(calibrate, "gptq_linear", gptq):
        held = calibrate.calibrated_weights(CheckpointDir(src), DecoderOnly(), "gptq", c["calib"], c["nsamples"],
                                            c["seqlen"], c["act_order"], c["damp"])
    return {module: stored["w"] for module, stored in held.items()}


def write_candidate(src: Path, out: Path, name: str, gptq: bool = False) -> Path:
    """out/NAME (out/NAME+gptq): the source with its decoder linears as candidate NAME (FORMAT or FORMAT+rot)
    holds them, rounded to nearest (by GPTQ)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    fmt, rotate = format_named(name.removesuffix("+rot")), name.endswith("+rot")
    weights = gptq_rounded(src, fmt, rotate) if gptq else None
    name = f"{name}+gptq" if gptq else name
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
                if LINEAR.fullmatch(key):
                    t = (rounded(t, fmt, rotate) if weights is None else weights[key.removesuffix(".weight")]).to(t.dtype)
                tensors[key] = t
        save_file(tensors, tmp / shard.name, metadata={"format": "pt"})
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


@click.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.argument("candidates", nargs=-1, required=True)
@click.option("--gptq", is_flag=True, help="round with GPTQ (as --preset q3) instead of to nearest")
def main(src: Path, out: Path, candidates: tuple[str, ...], gptq: bool):
    for name in candidates:
        click.echo(write_candidate(src, out, name, gptq))


if __name__ == "__main__":
    main()
