"""A seeded, bounded fuzzer for qlite's readers: flip bytes in a tiny checkpoint's safetensors header,
config.json and tokenizer_config.json, and in a tiny GGUF's metadata, then run one qlite command on
each mutant in this process (torch is imported once). Every case must end in exit 0 or in one clear
line on stderr: never a signal, a hang or a traceback.

    python tests/fuzz.py SOURCES_DIR CASES.json  # prints one JSON line per case as it ends
"""
from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import signal
import struct
import sys
from pathlib import Path

CASE_SECONDS = 60


def safetensors_header_end(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def gguf_metadata_end(path: Path) -> int:
    from gguf import GGUFReader
    return int(GGUFReader(path).data_offset)


def targets(sources: Path) -> list[tuple[str, str, int, int]]:
    """(source dir or file, the file to mutate inside it, start, end of the region to mutate)."""
    out = []
    for ckpt in ("ckpt", "int4"):
        st = sources / ckpt / "model.safetensors"
        out.append((ckpt, "model.safetensors", 0, safetensors_header_end(st)))
        for name in ("config.json", "tokenizer_config.json"):
            out.append((ckpt, name, 0, (sources / ckpt / name).stat().st_size))
    out.append(("tiny.gguf", "", 0, gguf_metadata_end(sources / "tiny.gguf")))
    return out


def make_cases(sources: Path, seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    regions = targets(sources)
    cases = []
    for i in range(count):
        source, name, start, end = rng.choice(regions)
        data = (sources / source / name).read_bytes() if name else (sources / source).read_bytes()
        flips = []
        digits = [j for j in range(start, end) if chr(data[j]).isdigit()] if name.endswith(".json") else []
        for _ in range(rng.randint(1, 3)):
            if digits and rng.random() < 0.5:  # a number changed, the JSON still valid
                j = rng.choice(digits)
                flips.append((j, data[j] ^ ord(rng.choice("0123456789"))))
            else:
                flips.append((rng.randrange(start, end), rng.randrange(1, 256)))
        cases.append({"id": i, "source": source, "file": name, "flips": flips})
    return cases


def command(case: dict, mutant: Path, out: Path) -> list[str]:
    if case["source"] == "tiny.gguf":
        return ["import-gguf", str(mutant), str(out)]
    generate = ["generate", "-m", str(mutant), "-p", "the thin tin", "--max-new-tokens", "3", "--dtype", "float32"]
    if case["source"] == "int4" or case["id"] % 2:
        return generate
    return ["quantize", str(mutant), "--out", str(out), "--group-size", "32"]


class Hang(BaseException):
    pass


def run(case: dict, sources: Path, work: Path) -> dict:
    from qlite.cli import main

    case_dir = work / f"case{case['id']}"
    src = sources / case["source"]
    if case["file"]:
        mutant = case_dir / case["source"]
        shutil.copytree(src, mutant)
        target = mutant / case["file"]
    else:
        case_dir.mkdir()
        mutant = target = case_dir / src.name
        shutil.copyfile(src, target)
    data = bytearray(target.read_bytes())
    for offset, xor in case["flips"]:
        data[offset] ^= xor
    target.write_bytes(bytes(data))
    err = io.StringIO()

    def hang(*_):
        raise Hang

    signal.signal(signal.SIGALRM, hang)
    signal.alarm(CASE_SECONDS)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(command(case, mutant, case_dir / "out"))
    except Hang:
        code = "hang"
    except BaseException as e:  # main() must never raise; record it
        code = f"raised {type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
    shutil.rmtree(case_dir, ignore_errors=True)
    return {**case, "code": code, "stderr": err.getvalue()}


if __name__ == "__main__":
    sources, cases_file = Path(sys.argv[1]), Path(sys.argv[2])
    work = sources / "work"
    work.mkdir(exist_ok=True)
    for case in json.loads(cases_file.read_text()):
        print(json.dumps({"start": case["id"]}), flush=True)
        print(json.dumps(run(case, sources, work)), flush=True)
