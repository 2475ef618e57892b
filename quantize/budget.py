"""`qlite quantize SRC --target-bpw B` / `--target-kld K`: a format for every unit (each decoder
layer's q/k/v, o_proj, gate/up and down_proj, the embeddings, lm_head) such that all tensors of the written checkpoint
together take at most B bits per parameter (every stored byte, norms and biases included, times 8,
over the source's parameter count), with the least estimated KLD.

Candidates are the formats with native kernels on every layer width they divide (those with a decode_ps; int4k-g32's
are the integer-activation products, which the AVX-512 and the AVX2 kernels both have), and 16-bit (the
source's own tensor, copied). Small int4 groups are int4k's (8-bit scales under a row scale): the error of
int4-g32 / -g64 in 0.25 / 0.125 fewer bits per weight; below 4 bits, int3k and int2k (which a 4- or 8-bit
preset and --target-kld leave out: least_bits). Each unit's cost in each format is its estimated KLD alone
(quantize/sensitivity.py); the costs are taken to add up (at 3 bits and below they compound: a mix's
measured KLD is then several times its estimate), and the mix is the cheapest whose bytes fit:
a multiple-choice knapsack (quantize/knapsack.py). The checkpoint is then written by the streaming converter
as any other, with per-module formats in its quantization_config (format_version 3).

`--no-slower-than FORMAT` adds a decode-time budget: the mix's estimated one-token step (each unit's
weights times its choice's decode_ps; the embeddings' lookup reads one row, so nothing) must take no
longer than that of the model in FORMAT (its decoder linears, lm_head int8: what `qlite quantize`
writes by default). Solved by pricing time in KLD: the knapsack on cost KLD + lambda x seconds, with
the smallest lambda (bisected) whose mix meets the time.

--target-kld K is the converse: the smallest mix whose measured mean KLD on each built-in text (the
quantization report's measurement) is at most K, found by writing and measuring a few mixes
(`kld_convert`)."""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from qlite.errors import QliteError
from qlite.formats import Format, budget_candidates, format_named
from qlite.outputs import atomic_output_dir
from qlite.qconfig import EMBEDDINGS, QuantConfig
from .convert import Summary, convert, plan_conversion, source_and_output
from .knapsack import choose
from .report import Reference, can_measure, reference
from .sensitivity import SAMPLES, SEQLEN, WINDOWS, Unit, calibration_windows, sensitivities, units

TRIALS = 5  # --target-kld: checkpoints written and measured at most
# Picoseconds per weight of a 16-bit decode step, the whole model's step over its weights; each quantized
# format's is its class's `decode_ps` (formats.py, measured the same way). The step's fixed part (attention,
# norms) is spread over every weight alike, which cancels in the one use of these numbers: comparing a mix
# with a reference model of the same weights. An AVX2 CPU's differ.
FLOAT_DECODE_PS = 35.8


def decode_ps(fmt: Format | None) -> float:
    return FLOAT_DECODE_PS if fmt is None else fmt.budget_ps
TABLE = "table"  # a tied model's embeddings and lm_head, chosen together (one stored copy when equal)


def stored_bytes(fmt: Format | None, shape: tuple[int, int], element_size: int) -> int:
    """Bytes of one [N, K] weight stored in fmt (None: copied, the source's element size)."""
    return math.prod(shape) * element_size if fmt is None else fmt.nbytes(*shape)


def unit_infos(src, unit: Unit) -> list:
    """The source tensors of the unit's modules (a tied model's head: the embeddings')."""
    name = "model.embed_tokens" if unit.name in (EMBEDDINGS, "lm_head") and src.config.tie_word_embeddings else None
    return [src.tensors[f"{name or m}.weight"] for m in unit.modules]


def unit_options(src, unit: Unit, skip: tuple[str, ...], least_bits: int = 0) -> list[tuple[Format | None, int]]:
    """(format, bytes) of each candidate of least_bits or more that fits every module of the unit; 16-bit always,
    only it if skipped."""
    infos = unit_infos(src, unit)
    fmts: list[Format | None] = [None]
    if not any(s and s in m for s in skip for m in unit.modules):
        for candidate in budget_candidates(least_bits):
            try:
                for info in infos:
                    candidate.check(info.shape[1], unit.name)
            except QliteError:
                continue
            fmts.append(candidate)
    return [(f, sum(stored_bytes(f, tuple(i.shape), torch.empty((), dtype=i.torch_dtype).element_size())
                    for i in infos)) for f in fmts]


class Mixer:
    """A source's units, their options (format, bytes) and, once measured, their estimated KLD; makes
    the least-KLD mix for a byte budget. least_bits: the candidates' fewest bits (a 4-bit preset: 4)."""

    def __init__(self, src, skip: tuple[str, ...], least_bits: int = 0):
        self.src, self.cfg, self.skip = src, src.config, skip
        self.units = units(self.cfg)
        self.modules = {u.name: u.modules for u in self.units}
        self.options = {u.name: unit_options(src, u, skip, least_bits) for u in self.units}
        self.params = sum(math.prod(info.shape) for info in src.tensors.values())
        held = {f"{m}.weight" for u in self.units for m in u.modules} | {f"{EMBEDDINGS}.weight"}
        self.fixed = sum(info.nbytes for name, info in src.tensors.items() if name not in held)  # norms, biases
        self.costs = {u: [0.0] * len(o) for u, o in self.options.items()}  # until measured
        # decode seconds of each option: weights read per token x decode_ps (a lookup reads one row: 0; a
        # mixture's expert is read by the share of tokens that choose it, k of its layer's experts: uniform
        # routing, which a router trained with a load-balancing loss aims at)
        e = self.cfg.experts
        share = 1.0 if e is None else e.per_token / e.count
        weights = {u.name: 0 if u.name == EMBEDDINGS else
                   sum(math.prod(i.shape) for i in unit_infos(src, u)) * (share if ".mlp.experts." in u.name else 1.0)
                   for u in self.units}
        self.seconds = {u: [1e-12 * weights[u] * decode_ps(f) for f, _ in o]
                        for u, o in self.options.items()}

    def table(self, price: float = 0.0) -> tuple[list[str], list[list[tuple[int, float]]]]:
        """The knapsack: names and, per name, its options' (bytes, cost), cost = KLD + price x decode
        seconds; a tied model's embeddings and head are one item of (table, head) pairs, one stored copy
        when they have one format."""
        tied = self.cfg.tie_word_embeddings
        cost = {u: [c + price * t for c, t in zip(self.costs[u], self.seconds[u])] for u in self.costs}
        names = [u.name for u in self.units if not (tied and u.name in (EMBEDDINGS, "lm_head"))]
        table = [[(b, cost[u][j]) for j, (_, b) in enumerate(self.options[u])] for u in names]
        if tied:
            emb, head = self.options[EMBEDDINGS], self.options["lm_head"]
            table.append([(be if fe == fh else be + bh, cost[EMBEDDINGS][i] + cost["lm_head"][j])
                          for i, (fe, be) in enumerate(emb) for j, (fh, bh) in enumerate(head)])
            names.append(TABLE)
        return names, table

    def bits_at_rate(self, rate: float) -> float:
        """The bits per parameter of a checkpoint whose units take `rate` bits per weight (a tied table
        once) and whose other tensors are as stored."""
        held = {f"{m}.weight" for u in self.units for m in u.modules} | {f"{EMBEDDINGS}.weight"}
        weights = sum(math.prod(info.shape) for name, info in self.src.tensors.items() if name in held)
        return (rate * weights + 8 * self.fixed) / self.params

    def bytes_for(self, bits_per_parameter: float) -> int:
        """The byte budget of the units for a whole-checkpoint bits-per-parameter budget."""
        return math.floor(bits_per_parameter * self.params / 8) - self.fixed

    def smallest_bits(self) -> float:
        return 8 * (self.fixed + sum(min(b for b, _ in o) for o in self.table()[1])) / self.params

    def largest_bytes(self) -> int:
        return sum(max(b for b, _ in o) for o in self.table()[1])

    def measure(self, windows: int, seqlen: int, samples: int, progress: bool, report: bool = True,
                data: str = "builtin") -> Reference | None:
        """The sensitivities on `data` windows (calibration_windows); and with `report`, the report's
        reference from the same forward pass."""
        ids = calibration_windows(self.src, windows, seqlen, data)
        candidates = {u: [f for f, _ in o if f is not None] for u, o in self.options.items()}
        ref = reference(self.src) if report else None
        measured = sensitivities(self.src, candidates, ids, samples, progress=progress,
                                 riders=(ref.windows,) if ref else ())
        self.costs = {u: [0.0 if f is None else measured[u][candidates[u].index(f)] for f, _ in o]
                      for u, o in self.options.items()}
        return ref.finish(self.src) if ref else None

    def mix(self, budget: int, max_seconds: float | None = None) -> tuple[dict[str, Format | None], float] | None:
        """The least-KLD mix within `budget` bytes of units (and, given max_seconds, an estimated decode
        step no longer): every module's format (lm_head and the embeddings included) and the estimated
        KLD; None if nothing fits."""
        found = self._mix(budget, 0.0)
        if found is None or max_seconds is None or self.decode_seconds(found[0]) <= max_seconds:
            return found
        def fitting(price: float):  # the mix at this price of a second (in nats), if its step fits
            found = self._mix(budget, price)
            return found if found is not None and self.decode_seconds(found[0]) <= max_seconds else None

        low, high = 0.0, 1.0  # raise the price until the time fits, then bisect
        while (best := fitting(high)) is None:
            if high > 1e12:
                return None
            low, high = high, high * 4
        for _ in range(40):
            mid = (low + high) / 2
            if (found := fitting(mid)) is not None:
                high, best = mid, found
            else:
                low = mid
        return best

    def _mix(self, budget: int, price: float) -> tuple[dict[str, Format | None], float] | None:
        names, table = self.table(price)
        pick = choose(table, budget)
        if pick is None:
            return None
        formats: dict[str, Format | None] = {}
        for name, j in zip(names, pick):
            if name == TABLE:
                i, k = divmod(j, len(self.options["lm_head"]))
                formats[EMBEDDINGS], formats["lm_head"] = self.options[EMBEDDINGS][i][0], self.options["lm_head"][k][0]
            else:
                formats.update(dict.fromkeys(self.modules[name], self.options[name][j][0]))
        return formats, self.kld(formats)

    def _option(self, unit: str, formats: dict) -> int:
        chosen = formats[self.modules[unit][0]]
        return next(j for j, (f, _) in enumerate(self.options[unit]) if f == chosen)

    def kld(self, formats: dict[str, Format | None]) -> float:
        """The estimated KLD of a mix (every module's format)."""
        return sum(self.costs[u][self._option(u, formats)] for u in self.options)

    def decode_seconds(self, formats: dict[str, Format | None]) -> float:
        """The estimated decode step of a mix (every module's format): its products' decode_ps."""
        return sum(self.seconds[u][self._option(u, formats)] for u in self.options)

    def reference_seconds(self, name: str) -> float:
        """The estimated decode step of the model in format `name` (a candidate), as `qlite quantize`
        writes it: every decoder linear it fits (the others, and skipped ones, 16-bit), lm_head int8."""
        names = [f.name for f in budget_candidates()]
        if name not in names:
            raise QliteError(f"--no-slower-than {name}: choose one of {', '.join(names)}")
        fmt, formats = format_named(name), {EMBEDDINGS: None, "lm_head": format_named("int8")}
        for u in self.units:
            if u.name not in (EMBEDDINGS, "lm_head"):
                fits = fmt in [f for f, _ in self.options[u.name]]
                formats.update(dict.fromkeys(u.modules, fmt if fits else None))
        return self.decode_seconds(formats)

    def qconfig(self, formats: dict[str, Format | None], params: dict, method: str = "rtn") -> QuantConfig:
        linears = {m: f for m, f in formats.items() if m not in (EMBEDDINGS, "lm_head")}
        main = Counter(f for f in linears.values() if f is not None).most_common(1)
        return QuantConfig(main[0][0] if main else format_named("int8"), formats["lm_head"], method, skip=self.skip,
                           params=params, embeddings=formats[EMBEDDINGS], module_formats=tuple(linears.items()))

    def bits(self, qconfig: QuantConfig) -> float:
        """Bits per parameter of the checkpoint the converter would write (its own plan)."""
        return 8 * sum(spec.nbytes for spec in plan_conversion(self.src, qconfig).specs) / self.params


def prepare(src, out, settings: dict, skip: tuple[str, ...], force: bool, flag: str,
            least_bits: int = 0) -> tuple[Mixer, Path]:
    """Check everything before the measurement: the source (as any quantize would), the output, the
    tokenizer the calibration text needs."""
    provisional = QuantConfig(format_named("int8"), format_named("int8"), skip=tuple(skip), params=settings,
                              embeddings=format_named("int8"))
    src, out = source_and_output(src, out, provisional, force)
    plan_conversion(src, provisional, report=False)
    if not can_measure(src):  # a broken one is an error here too
        raise QliteError(f"{flag}: {src.path} has no tokenizer.json to read the calibration text with")
    return Mixer(src, tuple(skip), least_bits), out


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def positive(value, flag: str, what: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise QliteError(f"{flag} {value}: must be a positive {what}")


def budget_convert(src: str | Path, out: str | Path | None = None, *, target_bpw: float | None = None,
                   skip: tuple[str, ...] = (), windows: int = WINDOWS, seqlen: int = SEQLEN, samples: int = SAMPLES,
                   data: str = "builtin", force: bool = False, max_shard_bytes: int = 2 << 30, progress: bool = True,
                   report: bool = True, method: str = "rtn", calibration: dict | None = None, no_slower_than: str | None = None,
                   rate: float | None = None, preset: str | None = None, least_bits: int = 0) -> Summary:
    """Quantize `src` to the least-KLD mix of formats within target_bpw bits per parameter (see the
    module docstring), or, given `rate` instead, within that many bits per quantizable weight
    (Mixer.bits_at_rate); returns the converter's Summary. method: rtn, or a calibrated one (gptq,
    act-rtn) with these calibrated_convert settings (calib, nsamples, seqlen, act_order, damp).
    no_slower_than: a format name; the mix's estimated decode step at most that model's. preset: the
    --preset name recorded (and the default output dir's suffix). least_bits: no candidate of fewer bits."""
    if rate is not None:
        positive(rate, "--preset", "number of bits per weight")
    else:
        positive(target_bpw, "--target-bpw", "number of bits per parameter")
    t0 = time.perf_counter()
    settings = {"sensitivity": {"windows": windows, "seqlen": seqlen, "samples": samples, "data": data}}
    settings.update({"preset": preset, "rate": rate} if rate is not None else {"target_bpw": target_bpw})
    if no_slower_than:
        settings["no_slower_than"] = no_slower_than
    mixer, out = prepare(src, out, settings, skip, force, "--target-bpw", least_bits)
    max_seconds = mixer.reference_seconds(no_slower_than) if no_slower_than else None
    if rate is not None:  # a preset always writes: its smallest mix, or without the speed bound, when it must
        target_bpw = math.floor(mixer.bits_at_rate(rate) * 1e4) / 1e4
        if mixer.mix(mixer.bytes_for(target_bpw)) is None:
            target_bpw = math.ceil(mixer.smallest_bits() * 1e4) / 1e4
            note(f"--preset {preset}: {rate:g} bits per weight is below {mixer.src.path}'s smallest mix (layer widths "
                 f"that its small formats do not divide); writing that, {target_bpw:g} bits per parameter")
        if max_seconds is not None and mixer.mix(mixer.bytes_for(target_bpw), max_seconds) is None:
            note(f"--preset {preset}: no mix within {target_bpw:g} bits per parameter decodes as fast as "
                 f"{no_slower_than} (estimated); writing the least-KLD mix within that size")
            max_seconds = None
            settings.pop("no_slower_than")
        settings["target_bpw"] = target_bpw
    budget = mixer.bytes_for(target_bpw)
    if mixer.mix(budget) is None:
        raise QliteError(f"--target-bpw {target_bpw:g}: below the smallest mix for {mixer.src.path} "
                         f"({mixer.smallest_bits():.3f} bits per parameter, every quantized tensor in its smallest format)")
    if max_seconds is not None and mixer.mix(budget, max_seconds) is None:
        raise QliteError(f"--no-slower-than {no_slower_than}: no mix within --target-bpw {target_bpw:g} decodes as fast "
                         f"(estimated)")
    ref = mixer.measure(windows, seqlen, samples, progress, report, data)
    formats, predicted = mixer.mix(budget, max_seconds)
    recorded = {**settings, "predicted_kld": round(predicted, 6)}
    if max_seconds is not None:
        recorded.update(predicted_decode_ms=round(1e3 * mixer.decode_seconds(formats), 3),
                        reference_decode_ms=round(1e3 * max_seconds, 3))
    if method != "rtn":
        from .calibrate import calibration_params
        recorded.update(calibration_params(**calibration))
    qconfig = mixer.qconfig(formats, recorded, method)
    if mixer.bits(qconfig) > target_bpw:  # the arithmetic above must agree with the writer's plan
        raise AssertionError(f"the mix takes {mixer.bits(qconfig)} bits per parameter, over --target-bpw {target_bpw}")
    writing = dict(force=force, max_shard_bytes=max_shard_bytes, progress=progress, report=report, ref=ref)
    if method != "rtn":
        from .calibrate import calibrated_convert
        summary = calibrated_convert(mixer.src.path, out, qconfig, method=method, **calibration, **writing)
    else:
        summary = convert(mixer.src.path, out, qconfig, **writing)
    return dataclasses.replace(summary, seconds=time.perf_counter() - t0)


def worst_kld(summary: Summary) -> float:
    """The larger of the built-in texts' mean KLD in the checkpoint's report."""
    return max(t["kld_mean"] for t in summary.fidelity["texts"].values())


def kld_convert(src: str | Path, out: str | Path | None = None, *, target_kld: float, skip: tuple[str, ...] = (),
                windows: int = WINDOWS, seqlen: int = SEQLEN, samples: int = SAMPLES, trials: int = TRIALS,
                force: bool = False, max_shard_bytes: int = 2 << 30, progress: bool = True) -> Summary:
    """The smallest mix found whose measured mean KLD on each built-in text (the report's measurement)
    is at most target_kld. The estimates rank the mixes; each trial writes one and measures it, and
    the next aims at the estimate scaled by target / measured, a bigger mix after a miss and a smaller
    one after a pass, and once a mix has missed and one has passed, the budget halfway between them
    (in bytes); the smallest that passed is kept (at most `trials` trials)."""
    positive(target_kld, "--target-kld", "mean KLD in nats")
    t0 = time.perf_counter()
    settings = {"target_kld": target_kld, "sensitivity": {"windows": windows, "seqlen": seqlen, "samples": samples}}
    # formats of 4 bits and more: below, the estimates that aim each trial compound (q3's: a third of its KLD)
    mixer, out = prepare(src, out, settings, skip, force, "--target-kld", least_bits=4)
    ref = mixer.measure(windows, seqlen, samples, progress)  # every trial is measured against it
    hi = mixer.largest_bytes()

    def smallest_budget(aim: float) -> int:  # the fewest bytes whose mix's estimate is at most `aim`
        low, high = 0, hi
        while low < high:
            mid = (low + high) // 2
            found = mixer.mix(mid)
            low, high = (low, mid) if found is not None and found[1] <= aim else (mid + 1, high)
        return low

    best, tried, aim, missed = None, {}, target_kld, -1  # missed: the largest budget whose mix missed
    with atomic_output_dir(out, force=force, inputs=(mixer.src.path,)) as tmp:
        for trial in range(trials):
            # between a miss and a pass: halve the bytes between them; else aim the estimate
            budget = (missed + best_budget) // 2 if best is not None and missed >= 0 else smallest_budget(aim)
            if budget in tried or budget <= missed or (best is not None and budget >= best_budget):
                break
            formats, predicted = mixer.mix(budget)
            qconfig = mixer.qconfig(formats, {**settings, "predicted_kld": round(predicted, 6)})
            summary = convert(mixer.src.path, tmp / f"trial{trial}", qconfig, max_shard_bytes=max_shard_bytes,
                              progress=False, ref=ref)
            tried[budget] = measured = worst_kld(summary)
            if progress:
                print(f"trial {trial + 1}: {summary.bits_per_parameter:.3f} bits per parameter, KLD {measured:.5f} "
                      f"(estimated {predicted:.5f})", file=sys.stderr)
            if measured <= target_kld:
                if best is not None:
                    shutil.rmtree(best.out_dir)
                best, best_budget = summary, budget
            else:
                shutil.rmtree(summary.out_dir)
                missed = max(missed, budget)
            aim = predicted * target_kld / measured if measured > 0 else aim
        if best is None:
            raise QliteError(f"--target-kld {target_kld:g}: no mix of {mixer.src.path} reached it in {len(tried)} "
                             f"trials (the closest: mean KLD {min(tried.values()):.5f}); the largest mix is "
                             f"{8 * (mixer.fixed + hi) / mixer.params:.2f} bits per parameter")
        for f in best.out_dir.iterdir():
            os.rename(f, tmp / f.name)
        for leftover in tmp.glob("trial*"):
            shutil.rmtree(leftover)
    return dataclasses.replace(best, out_dir=out, seconds=time.perf_counter() - t0)
