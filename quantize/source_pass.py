"""One pass over a 16-bit source's decoder layers, shared by everything quantizing measures on it.

Each layer is read from the source's files once per pass, in float32 (loader.float_layer), and every
set of token windows riding the pass goes through it in turn: the quantization report's reference
(the float model's outputs on the eval text), the sensitivities' forward (which keeps each layer's
input for its backward), GPTQ's and act-rtn's calibration (which then quantize the layer and run their
own windows through the quantized one: `after`). Memory: one layer, plus each set's activations.

What cannot share a pass: the sensitivities' backward goes through the layers again, top down (the
gradient at a layer needs every layer above it); a calibrated method's formats under --target-bpw
come from the sensitivities, so its pass follows theirs. quantize --target-bpw --method gptq thus reads
the source three times (sensitivities forward with the report's reference, their backward, GPTQ), and
plain RTN once (the reference)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from qlite.checkpoint import CheckpointDir
from qlite.loader import float_layer
from qlite.memory import large_allocations_from_mmap
from qlite.decoder.layers import DecoderLayer, RMSNorm, Rotary
from qlite.decoder.ops import Step
from qlite.qconfig import EMBEDDINGS


def float_config(src: CheckpointDir):
    """The source's config for its float layers."""
    return dataclasses.replace(src.config, quantization=None)


@dataclass
class Windows:
    """Token windows on their way through the source's layers."""
    x: torch.Tensor  # (windows, seqlen, hidden) float32: the current layer's input
    step: Step
    batch: int | None = None  # windows per forward, each batch's output replacing its input; None: all at once
    inputs: list[torch.Tensor] | None = None  # a list: every layer's input is kept there
    seconds: float = 0.0  # spent in the layers

    def through(self, layer: DecoderLayer) -> None:
        t0 = time.perf_counter()
        if self.inputs is not None:
            self.inputs.append(self.x)
        if self.batch is None or self.inputs is not None:
            self.x = layer(self.x, self.step)
        else:
            for i in range(0, self.x.shape[0], self.batch):  # windows are independent: never held twice
                self.x[i:i + self.batch] = layer(self.x[i:i + self.batch], self.step)
        self.seconds += time.perf_counter() - t0


def embedded(src: CheckpointDir, ids: torch.Tensor, batch: int | None = None, keep_inputs: bool = False) -> Windows:
    """ids (windows, seqlen) looked up in the source's embeddings, ready for layer 0 (the rows looked
    up in the stored dtype, then widened: a float32 copy of a 152k-row table would be 2.2 GB at 7B)."""
    x = torch.nn.functional.embedding(ids, src.read(f"{EMBEDDINGS}.weight")).float()  # (windows, seqlen, hidden)
    step = Step(*Rotary(float_config(src))(torch.arange(ids.shape[1])[None]), None, None, 0)
    return Windows(x, step, batch, [] if keep_inputs else None)


def source_pass(src: CheckpointDir, riders: list[Windows], after: Callable[[int, DecoderLayer], None] | None = None,
                progress: bool = True, desc: str = "source") -> None:
    """Read each decoder layer of `src` once; every rider goes through it, then `after(i, layer)`
    (which may change the layer's weights: the riders have already used them)."""
    from tqdm import tqdm

    cfg = float_config(src)
    large_allocations_from_mmap()  # layer after layer of freed float32 weights would otherwise fragment the heap
    for i in tqdm(range(cfg.num_hidden_layers), desc=desc, unit="layer", disable=not progress):
        layer = float_layer(src, cfg, i, experts_as_stored=after is None)  # `after` may change the weights
        for windows in riders:
            windows.through(layer)
        if after is not None:
            after(i, layer)
        del layer  # before the next is read: two float32 layers at once were 5 GB at Qwen3-30B-A3B's


def final_norm(src: CheckpointDir) -> RMSNorm:
    cfg = src.config
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.requires_grad_(False).copy_(src.read("model.norm.weight").float())
    return norm


def head_weight(src: CheckpointDir) -> torch.Tensor:
    """The head (vocab, hidden) as stored: the embedding table when tied."""
    return src.read(f"{EMBEDDINGS}.weight" if src.config.tie_word_embeddings else "lm_head.weight")
