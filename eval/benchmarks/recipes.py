"""`python -m eval.benchmarks.recipes SRC --gguf-from SRC.gguf`: the README's "Which recipe" table, measured in one run.
Each preset is made by `qlite quantize SRC --preset NAME` (timed, wall clock), scored by `qlite eval` against
SRC beside llama.cpp's Q4_0 and Q8_0 of the same model (made by llama.cpp's own quantizer from --gguf-from),
and timed by `python -m eval.benchmarks.bench` beside those files (decode and prefill, interleaved processes)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from .bench import llama_cpp_variants

PEERS = {"q4_0": "Q4_0", "q8_0": "Q8_0"}


def run(*args: str) -> None:
    click.echo("$ " + " ".join(args), err=True)
    subprocess.run(args, check=True)


def qlite(*args) -> tuple[str, ...]:
    return (sys.executable, "-m", "qlite.cli", *map(str, args))


def table(presets: list[str], made: dict, fidelity: dict, speed: dict, peers: dict) -> str:
    def kld(name, text):
        m = fidelity.get((name, text))
        return "-" if not m else f"{m['kld_mean']:.4f}" if m["kld_mean"] >= 0.01 else f"{m['kld_mean']:.5f}"

    def decode(name):
        row = speed.get(name)
        return f"{row['decode_tps'][0]:.0f} ({row['decode_tps'][1]:.0f}-{row['decode_tps'][2]:.0f})" if row else "-"

    def ratio(name, peer):
        a, b = speed.get(name), speed.get(peers.get(peer, ""))
        return f"{a['decode_tps'][0] / b['decode_tps'][0]:.2f}x" if a and b else "-"

    lines = ["| recipe | MiB | code KLD | prose KLD | decode tok/s | vs Q4_0 | vs Q8_0 | time to make |",
             "|---|---|---|---|---|---|---|---|"]
    for p in presets:
        lines.append(f"| `--preset {p}` | {made[p]['mib']:.0f} | {kld(p, 'code')} | {kld(p, 'prose')} | {decode(p)} "
                     f"| {ratio(p, 'q4_0')} | {ratio(p, 'q8_0')} | {made[p]['seconds']:.0f} s |")
    for peer, label in PEERS.items():
        name = peers.get(peer)
        if name:
            mib = speed[name]["size_mib"] if name in speed else float("nan")
            lines.append(f"| llama.cpp {label} | {mib:.0f} | {kld(name, 'code')} | {kld(name, 'prose')} "
                         f"| {decode(name)} | {ratio(name, 'q4_0')} | {ratio(name, 'q8_0')} | |")
    return "\n".join(lines)


@click.command()
@click.argument("src", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--gguf-from", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="a GGUF of SRC: llama.cpp's Q4_0 and Q8_0 are made from it (needs the bench extra)")
@click.option("--presets", default="fast,q4,q4-gptq,q8", show_default=True)
@click.option("--work", type=click.Path(path_type=Path), default=Path("/tmp/qlite-recipes"), show_default=True)
@click.option("--max-chunks", default=8, show_default=True, help="qlite eval chunks per text")
@click.option("--ctx", default=512, show_default=True, help="qlite eval tokens per chunk")
@click.option("--threads", default=2, show_default=True)
@click.option("--rounds", default=2, show_default=True, help="eval.benchmarks.bench processes per model, interleaved")
@click.option("--markdown", "md_path", type=click.Path(path_type=Path))
@click.option("--plot", "plot_dir", type=click.Path(path_type=Path, file_okay=False),
              help="also draw frontier.png and speed.png here (docs/ for the README's; needs matplotlib)")
def main(src, gguf_from, presets, work, max_chunks, ctx, threads, rounds, md_path, plot_dir):
    presets = [p for p in presets.split(",") if p]
    work.mkdir(parents=True, exist_ok=True)
    made = {}
    for p in presets:
        t0 = time.perf_counter()
        run(*qlite("quantize", src, "--preset", p, "--out", work / p, "--force"))
        made[p] = {"seconds": time.perf_counter() - t0,
                   "mib": sum(f.stat().st_size for f in (work / p).glob("*.safetensors")) / 2**20}
    ggufs = llama_cpp_variants(gguf_from, work / "llama-cpp", tuple(PEERS)) if gguf_from else []
    peers = {t: g.name for t, g in zip(PEERS, ggufs)}
    models = [work / p for p in presets] + ggufs
    run(*qlite("eval", *models, "--baseline", src, "--max-chunks", max_chunks, "--ctx", ctx, "--json", work / "eval.json"))
    fidelity = {(r["model"], r["data"]): r["metrics"] for r in json.loads((work / "eval.json").read_text())["rows"]}
    bench = [sys.executable, "-m", "eval.benchmarks.bench", *map(str, (work / p for p in presets)),
             *[a for g in ggufs for a in ("--gguf", str(g))], "--threads", str(threads), "--repeats", "2",
             "--rounds", str(rounds), "--json", str(work / "bench.json")]
    run(*bench)
    speed = {r["name"]: r for r in json.loads((work / "bench.json").read_text())["rows"] if "error" not in r}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    text = (f"{time.strftime('%Y-%m-%d')}, {cpu}, {threads} threads (`python -m eval.benchmarks.recipes {src} "
            f"{'--gguf-from ' + str(gguf_from) if gguf_from else ''}`): KLD against SRC on {max_chunks} chunks of {ctx} "
            f"tokens of each built-in text; decode of 128 tokens after a 512-token prompt, median (min-max) of "
            f"{rounds} x 2 runs.\n\n" + table(presets, made, fidelity, speed, peers))
    click.echo(text)
    if md_path:
        md_path.write_text(text + "\n")
    if plot_dir:
        plot_dir.mkdir(parents=True, exist_ok=True)
        plot(presets, made, fidelity, speed, peers, plot_dir, text.split("\n\n")[0])


def plot(presets: list[str], made: dict, fidelity: dict, speed: dict, peers: dict, out_dir: Path, how: str) -> dict:
    """frontier.png (MiB against KLD per text) and speed.png (decode tokens/s) of one run's rows."""
    from . import plots

    labels = {**{p: p for p in presets}, **{name: f"llama.cpp {PEERS[t]}" for t, name in peers.items()}}
    mib = {**{p: made[p]["mib"] for p in presets}, **{n: speed[n]["size_mib"] for n in peers.values() if n in speed}}
    points = [plots.Point(labels[name], mib[name], {t: fidelity[name, t]["kld_mean"] for t in ("code", "prose")},
                          llama_cpp=name not in presets)
              for name in labels if name in mib and all((name, t) in fidelity for t in ("code", "prose"))]
    bars = [(labels[name], *speed[name]["decode_tps"][:3], name not in presets) for name in labels if name in speed]
    title = how.split(" (`")[0]
    return {"frontier": plots.frontier(points, out_dir / "frontier.png", title=title),
            "speed": plots.speed(bars, out_dir / "speed.png", title=title)}


if __name__ == "__main__":
    main()
