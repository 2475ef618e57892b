"""Seeded byte flips in tiny checkpoints and a tiny GGUF (tests/fuzz.py): every run ends in exit 0
or one clear line naming what is wrong; never a signal, hang or traceback. QLITE_FUZZ_CASES sets
the count (CI runs a small one), QLITE_FUZZ_SEED the seed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz import CASE_SECONDS, make_cases
from tiny_models import make_checkpoint, write_tiny_gguf

COUNT = int(os.environ.get("QLITE_FUZZ_CASES", "100"))
SEED = int(os.environ.get("QLITE_FUZZ_SEED", "2026"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from quantize.convert import convert

    root = tmp_path_factory.mktemp("fuzz")
    make_checkpoint(root / "ckpt", vocab_size=320, hidden_size=64, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    convert(root / "ckpt", root / "int4", bits=4, group_size=32, progress=False)
    write_tiny_gguf(root / "tiny.gguf")
    return root


def test_flipped_bytes_end_cleanly(sources):
    cases = make_cases(sources, SEED, COUNT)
    (sources / "cases.json").write_text(json.dumps(cases))
    driver = Path(__file__).with_name("fuzz.py")
    r = subprocess.run([sys.executable, str(driver), str(sources), str(sources / "cases.json")],
                       capture_output=True, text=True, timeout=CASE_SECONDS * 4 + 20 * COUNT,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                                          os.environ.get("PYTHONPATH", "")])})
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    results = [x for x in lines if "code" in x]
    started = [x["start"] for x in lines if "start" in x]
    assert r.returncode == 0, f"the driver died ({r.returncode}) in case {started[-1:]}: {r.stderr[-2000:]}"
    assert len(results) == COUNT
    bad = []
    for x in results:
        err = x["stderr"].strip().splitlines()
        clean = x["code"] == 0 or (isinstance(x["code"], int) and len(err) == 1 and err[0].startswith("error: ")
                                   and "QLITE_DEBUG" not in err[0] and "Traceback" not in x["stderr"])
        if not clean:
            bad.append(f"case {x['id']} ({x['source']}/{x['file']} {x['flips']}): {x['code']}: {x['stderr'][-400:]}")
    assert not bad, "\n".join(bad)
