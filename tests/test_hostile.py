"""Hostile checkpoints and careless flags, as a new user meets them: every case exits non-zero with
one line on stderr naming the file or flag at fault, no traceback, nothing written outside the
requested output, and the source's bytes unchanged. (Earlier classes live beside what they test:
wrong dtypes, --force, links and index paths, config sizes in tests/quantize/test_convert.py;
chat templates in tests/qlite/test_chat_template.py; output claims in tests/qlite/test_outputs.py;
random byte flips in tests/test_fuzz.py.)"""
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qlite.cli import main
from qlite.outputs import atomic_output_dir, mark
from tiny_models import make_checkpoint

PROGRESS = re.compile(r"\d+%\|")
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hostile") / "ckpt", seed=9, **SIZES)


@pytest.fixture
def ckpt(pristine, tmp_path):
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def fails_cleanly(capsys, root: Path, args, *needles: str) -> str:
    """Run the CLI; assert a one-line error holding every needle and that nothing under root changed."""
    before = snapshot(root)
    code = main([str(a) for a in args])
    _, err = capsys.readouterr()
    lines = [line for line in err.strip().splitlines()  # tqdm's bars (and the blanks that clear them) may precede it
             if not PROGRESS.search(line) and line.strip()]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and "QLITE_DEBUG" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert snapshot(root) == before, "something was written or changed"
    return lines[0]


def edit_tensor(path: Path, name: str, change) -> None:
    tensors = load_file(path)
    tensors[name] = change(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# 9: non-finite values

@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_is_named_at_load_and_quantize(capsys, ckpt, tmp_path, value):
    name = "model.layers.0.mlp.down_proj.weight"
    edit_tensor(ckpt / "model.safetensors", name, lambda t: t.index_put_((torch.tensor([3]), torch.tensor([5])),
                                                                         torch.tensor(value, dtype=t.dtype)))
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "model.safetensors", name, "NaN or infinite")
    fails_cleanly(capsys, tmp_path, ["quantize", ckpt, "--out", tmp_path / "q", "--group-size", "32"], name)


def test_non_finite_scale_of_a_quantized_checkpoint_is_named(capsys, pristine, tmp_path):
    q = tmp_path / "q"
    assert main(["quantize", str(pristine), "--out", str(q), "--group-size", "32"]) == 0
    capsys.readouterr()
    name = "model.layers.0.self_attn.o_proj.scales"
    edit_tensor(q / "model.safetensors", name, lambda t: t * float("inf"))
    fails_cleanly(capsys, tmp_path, ["generate", "-m", q, "-p", "hi"], name, "NaN or infinite")


def test_logits_that_overflow_stop_generation_with_an_error(capsys, ckpt, tmp_path):
    """Finite weights whose products overflow: the final norm's weight at 1e38 in float32."""
    edit_tensor(ckpt / "model.safetensors", "model.norm.weight", lambda t: torch.full_like(t, 1e38))
    line = fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi", "--dtype", "float32",
                                            "--temperature", "0.7"], "logits are NaN or infinite")
    assert "--temperature" not in line


# 12, 13: flags checked when parsed, before anything loads; each message names its flag

@pytest.mark.parametrize("args, flag", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"), (["--top-k", "-1"], "--top-k"),
    (["--repetition-penalty", "inf"], "--repetition-penalty"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--kernel", "fast"], "--kernel"), (["--dtype", "int8"], "--dtype"), (["--min-p", "1"], "--min-p"),
    (["--min-p", "nan"], "--min-p"), (["--threads", "0"], "--threads"),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_generate_flags_are_named_before_loading(capsys, tmp_path, args, flag, command):
    prompt = ["-p", "hi"] if command == "generate" else []
    fails_cleanly(capsys, tmp_path, [command, "-m", tmp_path / "no-such-model", *prompt, *args], flag)


@pytest.mark.parametrize("args, flag", [
    (["--bits", "3"], "--bits"), (["--group-size", "-4"], "--group-size"), (["--nsamples", "0"], "--nsamples"),
    (["--seqlen", "1"], "--seqlen"), (["--damp", "nan"], "--damp"), (["--max-shard-size", "lots"], "--max-shard-size"),
])
def test_bad_quantize_flags_are_named_before_reading(capsys, tmp_path, args, flag):
    fails_cleanly(capsys, tmp_path, ["quantize", tmp_path / "no-such-model", "--out", tmp_path / "q", *args], flag)


def test_kernel_that_runs_only_quantized_layers_on_a_16_bit_model(capsys, ckpt, tmp_path):
    for kernel in ("aten", "bnb"):
        fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi", "--kernel", kernel],
                      f"--kernel {kernel}", "16-bit checkpoint")


def test_skip_that_names_no_layer(capsys, ckpt, tmp_path):
    fails_cleanly(capsys, tmp_path, ["quantize", ckpt, "--out", tmp_path / "q", "--skip", "down_proj,dwon_proj"],
                  "--skip dwon_proj", "names no linear layer")


def test_checkpoint_group_size_that_does_not_divide_names_the_config_not_a_flag(capsys, pristine, tmp_path):
    q = tmp_path / "q"
    assert main(["quantize", str(pristine), "--out", str(q), "--group-size", "32"]) == 0
    capsys.readouterr()
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 48
    (q / "config.json").write_text(json.dumps(cfg))
    line = fails_cleanly(capsys, tmp_path, ["generate", "-m", q, "-p", "hi"], f"{q / 'config.json'}",
                         "group size 48 does not divide")
    assert "--group-size" not in line
    cfg["quantization_config"].update(group_size=32, embed_format="int4-g48")  # the table's own format
    (q / "config.json").write_text(json.dumps(cfg))
    fails_cleanly(capsys, tmp_path, ["generate", "-m", q, "-p", "hi"], f"{q / 'config.json'}",
                  "group size 48 does not divide model.embed_tokens")


def test_sampling_value_from_generation_config_names_that_file(capsys, ckpt, tmp_path):
    edit_json(ckpt / "generation_config.json", do_sample=True, temperature=-2)
    line = fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "generation_config.json",
                         "temperature must be >= 0")
    assert "--temperature" not in line


@pytest.mark.parametrize("content, message", [('"qwen2"', "holds a JSON str, not an object"),
                                              ("[1, 2]", "holds a JSON list, not an object"),
                                              ("\xff\xfe{}", "not UTF-8 text")])
def test_config_that_is_not_an_object(capsys, ckpt, tmp_path, content, message):
    (ckpt / "config.json").write_bytes(content.encode("latin-1"))
    for args in (["generate", "-m", ckpt, "-p", "hi"], ["info", ckpt], ["quantize", ckpt, "--out", tmp_path / "q"]):
        fails_cleanly(capsys, tmp_path, args, f"{ckpt / 'config.json'}: {message}")


def test_tokenizer_config_that_is_a_list(capsys, ckpt, tmp_path):
    (ckpt / "tokenizer_config.json").write_text("[]")
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "tokenizer_config.json: holds a JSON list")


def test_weights_file_that_is_a_directory(capsys, ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").mkdir()
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "model.safetensors: not a regular file")


def test_config_that_is_a_directory(capsys, ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()
    fails_cleanly(capsys, tmp_path, ["info", ckpt], "config.json: is a directory, not a regular file")


def test_prompt_that_is_not_utf8(capsys, ckpt, tmp_path, monkeypatch):
    class Stdin(io.TextIOWrapper):
        def isatty(self):
            return False

    monkeypatch.setattr(sys, "stdin", Stdin(io.BytesIO(b"def f():\n    return '\xff\xfe'\n")))
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt], "stdin: the prompt is not UTF-8 text")
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "bad \udcff byte"], "--prompt: not UTF-8")


def test_chat_template_that_never_ends(capsys, ckpt, tmp_path):
    edit_json(ckpt / "tokenizer_config.json",
              chat_template="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "tokenizer_config.json: chat template refused")
    assert time.monotonic() - t0 < 30


# 7, 11: concurrent runs and leftovers, through the CLI

def test_a_run_into_an_output_being_written_is_refused(capsys, pristine, tmp_path):
    out = tmp_path / "q"
    with atomic_output_dir(out):  # another run, alive, writing q
        fails_cleanly(capsys, tmp_path, ["quantize", pristine, "--out", out, "--group-size", "32"],
                      f"{out}: another qlite run is writing it")


def test_leftovers_of_a_killed_run_are_named_and_removed(capsys, pristine, tmp_path):
    out = tmp_path / "q"
    proc = subprocess.Popen([sys.executable, "-m", "qlite", "quantize", str(pristine), "--out", str(out),
                             "--group-size", "32"], stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and not any(tmp_path.glob(".q.tmp-*")):
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    left = sorted(p.name for p in tmp_path.glob(".q.*"))
    if out.exists():  # it finished first; make the leftover by hand as a killed run leaves it
        shutil.rmtree(out)
        (tmp_path / ".q.tmp-killed").mkdir()
        mark(tmp_path / ".q.tmp-killed", out)
        left = [".q.tmp-killed"]
    assert left
    assert main(["quantize", str(pristine), "--out", str(out), "--group-size", "32"]) == 0
    err = capsys.readouterr().err
    assert all(f"removed {tmp_path / name}, left by an interrupted run" in err for name in left), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


# 13: Ctrl-C while the command starts

@pytest.mark.parametrize("after", [0.3, 1.0, 2.0])
def test_ctrl_c_during_start_up_is_one_line(pristine, after):
    proc = subprocess.Popen([sys.executable, "-m", "qlite", "generate", "-m", str(pristine), "-p", "hi",
                             "--max-new-tokens", "200"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 130), err  # 0: it had already finished
    assert proc.returncode == 0 or err == "error: interrupted\n", err
    assert "Traceback" not in err


@pytest.mark.parametrize("code", [0, 130])
def test_ctrl_c_handled_inside_an_exec_keeps_the_exit_code(tmp_path, code):
    """CPython 3.11 ends a `python -m` process by SIGINT after any KeyboardInterrupt that left an exec() of
    a string, even a handled one (what made the test above fail now and then): qlite exits with its code."""
    (tmp_path / "probe.py").write_text(
        "import qlite.cli as cli\n"
        "def main():\n"
        "    try:\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    except KeyboardInterrupt:\n"
        f"        return {code}\n"
        "cli.main = main\n"
        "cli.entry_point()\n")
    proc = subprocess.run([sys.executable, "-m", "probe"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == code, proc.stderr
