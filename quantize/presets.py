"""`qlite quantize --preset NAME`: the recipes a user chooses among, by name; `qlite quantize SRC` with no
format options is DEFAULT. A budget preset's size is llama.cpp's nominal rate for its type on every
tensor it may quantize (decoder linears, lm_head, embeddings; the rest as stored): Q4_0 stores 18 bytes
per 32 weights (4.5 bits), Q8_0 34 (8.5 bits), so the file is no bigger than that type at that rate
(llama.cpp's own Q4_0 files keep some tensors at more bits). Figures: README "Which recipe"."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from qlite.errors import QliteError


@dataclass(frozen=True)
class Preset:
    summary: str
    fixed: dict | None = None  # a single-format recipe: QuantConfig.from_options' options
    rate: float | None = None  # a mix: bits per quantizable weight (--target-bpw follows from the model)
    no_slower_than: str | None = None  # a mix's decode-time bound (budget.py)
    method: str = "rtn"
    calibration: dict = field(default_factory=dict)  # calibrated_convert's settings
    sensitivity: dict = field(default_factory=dict)  # budget_convert's windows / samples (else its defaults)
    least_bits: int = 0  # a mix's fewest-bit candidates (a 4-bit preset mixes nothing below 4 bits)


GPTQ_CALIBRATION = dict(calib="builtin", nsamples=32, seqlen=512, act_order=True, damp=0.3)
PRESETS = {
    "fast": Preset("int4-g128 everywhere but an int8 lm_head and table, round to nearest: seconds",
                   fixed=dict(bits=4, group_size=128)),
    "q4": Preset("the least-KLD mix at Q4_0's rate (4.5 bits per weight) that decodes as fast as int4-g128, "
                 "round to nearest, sensitivities from 2 short windows of coding conversations in the model's chat "
                 "template (plain text where it has none): under 2 minutes on a 0.5B model",
                 rate=4.5, no_slower_than="int4-g128", sensitivity=dict(windows=2, samples=2, data="chat"),
                 least_bits=4),
    "q4-gptq": Preset("the same budget and speed, the mix chosen from 8 windows and quantized with GPTQ "
                      "(32 calibration windows, act-order): minutes",
                      rate=4.5, no_slower_than="int4-g128", method="gptq",
                      calibration=GPTQ_CALIBRATION, least_bits=4),
    "q8": Preset("the least-KLD mix at Q8_0's rate (8.5 bits per weight), round to nearest: minutes", rate=8.5,
                 least_bits=4),
    "q3": Preset("the least-KLD mix at 3.5 bits per weight (llama.cpp's Q3_K: 3.44) of the 3-bit formats and up "
                 "(int3k; not int2k, whose real cost the estimate understates), quantized with GPTQ as q4-gptq: "
                 "minutes", rate=3.5, method="gptq", calibration=GPTQ_CALIBRATION, least_bits=3),
    "q2": Preset("the least-KLD mix at 2.6 bits per weight (llama.cpp's Q2_K: 2.63) of every format, int2k "
                 "included, quantized with GPTQ as q4-gptq: minutes", rate=2.6, method="gptq",
                 calibration=GPTQ_CALIBRATION),
}
DEFAULT = "q4"


def preset_names() -> list[str]:
    return list(PRESETS)


def quantize_preset(name: str | None, src, out=None, *, skip: tuple[str, ...] = (), force: bool = False,
                    max_shard_bytes: int = 2 << 30, report: bool = True, progress: bool = True):
    """Quantize `src` with the named preset (None: DEFAULT, or `fast` for a source without a tokenizer,
    which a mix needs to measure with); returns the converter's Summary."""
    if name is None:
        from qlite.checkpoint import CheckpointDir
        from .report import can_measure
        name = DEFAULT
        if not can_measure(CheckpointDir(Path(src).expanduser())):
            print(f"note: {src} has no tokenizer.json to measure a mix with; writing --preset fast", file=sys.stderr)
            name = "fast"
    if name not in PRESETS:
        raise QliteError(f"--preset {name}: choose {', '.join(PRESETS)}")
    preset = PRESETS[name]
    writing = dict(force=force, max_shard_bytes=max_shard_bytes, report=report, progress=progress)
    if preset.fixed is not None:
        from .convert import convert
        from qlite.qconfig import QuantConfig
        qconfig = QuantConfig.from_options(**preset.fixed, skip=skip, params={"preset": name})
        return convert(src, out, qconfig, **writing)
    from .budget import budget_convert
    sensitivity = dict(preset.sensitivity)
    if sensitivity.get("data") == "chat" and not has_chat_template(src):
        sensitivity["data"] = "builtin"
    calibration = dict(preset.calibration)
    if calibration:  # windows no longer than the model's context
        from qlite.checkpoint import CheckpointDir
        calibration["seqlen"] = min(calibration["seqlen"], CheckpointDir(Path(src).expanduser()).config.max_position_embeddings)
    return budget_convert(src, out, rate=preset.rate, preset=name, skip=skip, method=preset.method,
                          calibration=calibration, no_slower_than=preset.no_slower_than,
                          least_bits=preset.least_bits,
                          **sensitivity, **writing)


def has_chat_template(src) -> bool:
    """Whether the source's tokenizer has a chat template (no tokenizer: budget_convert says so)."""
    from qlite.tokenizer import Tokenizer

    path = Path(src).expanduser()
    return (path / "tokenizer.json").is_file() and Tokenizer(path).chat_template is not None
