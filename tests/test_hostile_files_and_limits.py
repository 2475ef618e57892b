"""Hostile files, links, sizes, config values and signals: each case a probe found, as its own test. Every case ends without a
signal or a hang past its bound, with a one-line error naming the file, field or flag at fault (or
a clean success where the input was legitimate), the inputs byte-identical, nothing read outside
the checkpoint. Commands that once crashed the process run in a subprocess, so a regression is a
failed test, not a dead test run. (Server cases: tests/qlite/serve/test_server.py; templates:
tests/qlite/test_chat_template.py; temp-dir ownership: tests/qlite/test_outputs.py.)"""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_hostile import SIZES, ckpt, edit_json, fails_cleanly, pristine, snapshot  # noqa: F401 (fixtures)
from tiny_models import make_checkpoint, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=300, env=None):
    """`python -m qlite ARGS` in a subprocess: (exit status, stderr); a signal is a negative status."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    r = subprocess.run([sys.executable, "-m", "qlite", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    return r.returncode, r.stderr


def one_line(status_err, *needles):
    status, err = status_err
    lines = [line for line in err.strip().splitlines() if "%|" not in line]
    assert status == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def ok(status_err):
    status, err = status_err
    assert status == 0, f"exit {status}: {err[-2000:]}"


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    """A file outside every checkpoint, which nothing may read."""
    path = tmp_path_factory.mktemp("outside") / "secret.json"
    path.write_text(json.dumps({"secret": "s3cr3t-value"}))
    return path


# 1a. segfaults in the aten int8 kernel (K not a multiple of 16, a misaligned weight)

@pytest.fixture(scope="module")
def odd_width(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("odd") / "ckpt", seed=3, **{**SIZES, "intermediate_size": 168})


def test_int8_of_a_width_not_a_multiple_of_16_quantizes_reports_and_runs(odd_width, tmp_path):
    out = tmp_path / "q8"
    ok(run("quantize", odd_width, "--bits", "8", "--out", out))  # the report runs the model too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q8"]
    for kernel in ("auto", "reference"):
        ok(run("generate", "-m", out, "-p", "hi", "--max-new-tokens", "3", "--kernel", kernel))
    one_line(run("generate", "-m", out, "-p", "hi", "--kernel", "aten"), "--kernel aten: cannot run",
             "down_proj", "64x168")
    ok(run("eval", out, "--baseline", odd_width, "--max-chunks", "1", "--ctx", "32", "--data", "code"))


def test_target_bpw_6_on_a_tiny_model(tmp_path):
    src = make_checkpoint(tmp_path / "tiny", seed=1)
    ok(run("quantize", src, "--target-bpw", "6", "--out", tmp_path / "mix"))


def test_int4_group_16_quantizes_with_its_report(pristine, tmp_path):
    ok(run("quantize", pristine, "--group-size", "16", "--out", tmp_path / "g16"))


def pad_header(path: Path, extra: int) -> None:
    """The same safetensors file with `extra` more spaces in its JSON header: every tensor's bytes move
    by `extra`, so views of the mapped file lose their 16-byte alignment. Still a valid file."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    path.write_bytes(struct.pack("<Q", n + extra) + data[8:8 + n] + b" " * extra + data[8 + n:])


@pytest.mark.parametrize("how", [["--kernel", "aten"], ["--kernel", "auto"]])
def test_a_misaligned_int8_file_runs_on_the_aten_kernel(pristine, tmp_path, how):
    out = tmp_path / "q8"
    ok(run("quantize", pristine, "--bits", "8", "--no-report", "--out", out))
    pad_header(out / "model.safetensors", 8)
    assert load_file(out / "model.safetensors")  # still valid
    ok(run("generate", "-m", out, "-p", "hi there", "--max-new-tokens", "6", *how, env={"QLITE_NATIVE": "0"}))


# 1b. --threads past what OpenMP takes

@pytest.mark.parametrize("threads", ["100000", "20000"])
def test_absurd_thread_counts_are_refused(capsys, pristine, tmp_path, threads):
    fails_cleanly(capsys, tmp_path, ["generate", "-m", pristine, "-p", "hi", "--threads", threads],
                  f"--threads {threads}: must be an integer from 1 to")


# 2a. leftovers recognised by name alone

def test_a_source_moved_to_a_leftover_name_is_never_deleted(pristine, tmp_path):
    src = tmp_path / ".m.old-1"
    shutil.copytree(pristine, src)
    before = snapshot(src)
    ok(run("quantize", src, "--out", tmp_path / "m", "--group-size", "32", "--no-report"))
    assert snapshot(src) == before


def test_a_users_own_dir_named_like_a_temp_dir_is_never_deleted(pristine, tmp_path):
    mine = tmp_path / ".out.tmp-mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    ok(run("quantize", pristine, "--out", tmp_path / "out", "--group-size", "32", "--no-report"))
    assert (mine / "notes.txt").read_text() == "mine"


# 2b. an output flag that names an input

@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_eval_reports_never_overwrite_an_input(capsys, pristine, tmp_path, flag):
    q = tmp_path / "q"
    ok(run("quantize", pristine, "--out", q, "--group-size", "32", "--no-report"))
    base = Path(shutil.copytree(pristine, tmp_path / "base"))
    fails_cleanly(capsys, tmp_path, ["eval", q, "--baseline", base, flag, base / "model.safetensors"],
                  f"{flag} {base / 'model.safetensors'}: lies inside the input")
    fails_cleanly(capsys, tmp_path, ["eval", q, "--baseline", base, flag, q / "config.json"], "lies inside the input")


# 3a. the hub-cache exception, when blobs is itself a link

def hub_snapshot(root: Path, pristine: Path, blobs_elsewhere: Path | None = None) -> Path:
    """HUB/models--x/snapshots/rev/FILE -> ../../blobs/FILE, as the hub lays a model out; with
    blobs_elsewhere, blobs is a link to that dir (a hostile cache)."""
    model = root / "models--x"
    snap = model / "snapshots" / "rev"
    snap.mkdir(parents=True)
    blobs = model / "blobs"
    if blobs_elsewhere is None:
        blobs.mkdir()
        target = blobs
    else:
        blobs.symlink_to(blobs_elsewhere, target_is_directory=True)
        target = blobs_elsewhere
    for f in pristine.iterdir():
        shutil.copyfile(f, target / f.name)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    return snap


def test_a_real_hub_snapshot_still_quantizes(pristine, tmp_path):
    snap = hub_snapshot(tmp_path / "hub", pristine)
    ok(run("quantize", snap, "--out", tmp_path / "q", "--group-size", "32", "--no-report"))


def test_a_hub_snapshot_whose_blobs_link_elsewhere_is_refused(pristine, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    snap = hub_snapshot(tmp_path / "hub", pristine, blobs_elsewhere=elsewhere)
    (elsewhere / "stolen.txt").write_text("not the model's")
    (snap / "stolen.txt").symlink_to(Path("..", "..", "blobs", "stolen.txt"))
    one_line(run("quantize", snap, "--out", tmp_path / "q", "--group-size", "32", "--no-report"), "outside")
    assert not (tmp_path / "q").exists()


# 3b. links read, not only when copied

SIDE_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]


@pytest.mark.parametrize("name", SIDE_FILES)
@pytest.mark.parametrize("command", ["generate", "quantize", "info"])
def test_a_side_file_linking_outside_is_refused_when_read(capsys, ckpt, tmp_path, secret, name, command):
    if name == "chat_template.jinja":  # read only when tokenizer_config.json has no template
        config = json.loads((ckpt / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    (ckpt / name).unlink(missing_ok=True)
    (ckpt / name).symlink_to(secret)
    args = {"generate": ["generate", "-m", ckpt, "-p", "hi"],
            "quantize": ["quantize", ckpt, "--out", tmp_path / "q", "--group-size", "32", "--no-report"],
            "info": ["info", ckpt]}[command]
    if command == "info" and name not in ("config.json",):
        assert main_out(capsys, args) is not None  # info reads only config and headers
        return
    line = fails_cleanly(capsys, tmp_path, args, str(ckpt / name), "outside")
    assert "s3cr3t" not in line and not (tmp_path / "q").exists()


def main_out(capsys, args):
    from qlite.cli import main
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == 0 and "s3cr3t" not in out + err, err
    return out


def test_a_linked_report_is_not_read_by_info(capsys, pristine, tmp_path, secret):
    q = tmp_path / "q"
    ok(run("quantize", pristine, "--out", q, "--group-size", "32", "--no-report"))
    (q / "quantization_report.json").unlink(missing_ok=True)
    (q / "quantization_report.json").symlink_to(secret)
    out = main_out(capsys, ["info", q])
    assert "quantization_report.json: links to" in out and "outside" in out


def test_a_linked_quantize_config_is_not_read_by_import(capsys, pristine, tmp_path, secret):
    gptq = tmp_path / "gptq"
    q = tmp_path / "q"
    ok(run("quantize", pristine, "--out", q, "--group-size", "32", "--no-report"))
    ok(run("export", q, "--to", "gptq", "--out", gptq))
    config = json.loads((gptq / "config.json").read_text())
    (gptq / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (gptq / "config.json").write_text(json.dumps(config))
    ok(run("import", gptq, "--out", tmp_path / "back"))  # a real quantize_config.json is read
    (gptq / "quantize_config.json").unlink()
    (gptq / "quantize_config.json").symlink_to(secret)
    fails_cleanly(capsys, tmp_path, ["import", gptq, "--out", tmp_path / "again"], "quantize_config.json", "outside")


# 4. FIFOs and devices: an error, never a hang

# (every side file as a FIFO, a device, ...: the sweep at the end of this file)

@pytest.mark.parametrize("source", ["fifo", "/dev/zero"])
def test_calibration_and_task_files_that_never_end_are_errors(pristine, tmp_path, source):
    if source == "fifo":
        source = tmp_path / "calib.txt"
        os.mkfifo(source)
    kind = "FIFO" if isinstance(source, Path) else "device"
    one_line(run("quantize", pristine, "--method", "gptq", "--calib-data", source, "--nsamples", "2", "--seqlen", "16",
                 "--group-size", "32", "--out", tmp_path / "q", timeout=120), "--calib-data", kind)
    one_line(run("eval", pristine, "--baseline", pristine, "--data", "none", "--tasks", source, timeout=120),
             "--tasks", kind)
    one_line(run("eval", pristine, "--baseline", pristine, "--data", source, "--ctx", "32", timeout=120), "--data", kind)


def test_a_fifo_gguf_is_an_error_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "m.gguf")
    one_line(run("import-gguf", tmp_path / "m.gguf", tmp_path / "out", timeout=120), "m.gguf", "FIFO")


def test_a_backtracking_targets_regex_is_an_error_in_bounded_time(pristine, tmp_path, monkeypatch):
    """Python's re backtracks for minutes on this pattern; the regex package, with its timeout, does not."""
    q, ct = tmp_path / "q", tmp_path / "ct"
    ok(run("quantize", pristine, "--out", q, "--group-size", "32", "--no-report"))
    ok(run("export", q, "--to", "compressed-tensors", "--out", ct))
    config = json.loads((ct / "config.json").read_text())
    group = next(iter(config["quantization_config"]["config_groups"].values()))
    group["targets"] = ["re:(.|.)*(.|.)*(.|.)*(.|.)*X$"]
    (ct / "config.json").write_text(json.dumps(config))
    t0 = time.monotonic()
    one_line(run("import", ct, "--out", tmp_path / "back", timeout=120), "no config group names it")
    assert time.monotonic() - t0 < 100
    import regex
    from qlite.errors import QliteError
    from quantize.interchange import _matches

    def slow(*args, **kwargs):  # a pattern that would take longer than its bound
        raise TimeoutError
    monkeypatch.setattr(regex, "match", slow)
    with pytest.raises(QliteError, match=r"^c.json: target 're:\(\.\|\.\)\*.*' took longer than 1 s to match .*simplify"):
        _matches(group["targets"], "model.layers.0.mlp.up_proj", "c.json")


def test_a_21_mb_chat_template_is_refused_at_once(capsys, ckpt, tmp_path):
    edit_json(ckpt / "tokenizer_config.json", chat_template="{{ 'x' }}" * 2_400_000)
    t0 = time.monotonic()
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "tokenizer_config.json", "more than the")
    assert time.monotonic() - t0 < 30


def test_an_oversized_side_file_is_refused_without_reading_it_all(capsys, ckpt, tmp_path):
    with open(ckpt / "generation_config.json", "wb") as f:
        f.truncate(300 * 2**20)  # sparse: 300 MiB of zeros
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "generation_config.json", "larger than")


# 6. silently wrong: features, stored values, coercion

@pytest.mark.parametrize("field, value", [
    ("rope_scaling", {"type": "su", "factor": 4.0}),  # Phi-3's early name for LongRoPE
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}),
    ("rope_scaling", {"type": "yarn", "factor": -4.0}),
    ("use_sliding_window", True),
])
def test_unimplemented_config_features_are_refused_by_name(capsys, ckpt, tmp_path, field, value):
    edit_json(ckpt / "config.json", **{field: value})
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "config.json", field.split("_")[0],
                  "needs a positive factor" if isinstance(value, dict) and value.get("factor", 0) < 0 else "does not implement")


@pytest.mark.parametrize("field, value, needle", [
    ("hidden_size", 64.7, "hidden_size must be an integer, got 64.7"),
    ("hidden_size", "64", "hidden_size must be an integer, got '64'"),
    ("num_hidden_layers", 2.9, "num_hidden_layers must be an integer"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a number"),
    ("num_key_value_heads", True, "num_key_value_heads must be an integer, got True"),
    ("eos_token_id", "263", "eos_token_id must be an integer"),
])
def test_config_values_are_never_coerced(capsys, ckpt, tmp_path, field, value, needle):
    edit_json(ckpt / "config.json", **{field: value})
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "config.json", needle)
    fails_cleanly(capsys, tmp_path, ["info", ckpt], needle)


def test_gptq_sym_as_a_string_is_refused(capsys, pristine, tmp_path):
    q, gptq = tmp_path / "q", tmp_path / "gptq"
    ok(run("quantize", pristine, "--out", q, "--group-size", "32", "--no-report"))
    ok(run("export", q, "--to", "gptq", "--out", gptq))
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"]["sym"] = "false"
    (gptq / "config.json").write_text(json.dumps(config))
    fails_cleanly(capsys, tmp_path, ["import", gptq, "--out", tmp_path / "back"], "sym must be true or false, got 'false'")


@pytest.fixture(scope="module")
def quantized(pristine, tmp_path_factory):
    q = tmp_path_factory.mktemp("q") / "q"
    ok(run("quantize", pristine, "--out", q, "--group-size", "32", "--no-report"))
    return q


def edit_tensor(path: Path, name: str, change) -> None:
    tensors = load_file(path)
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("to", ["gguf", "gptq", "compressed-tensors"])
def test_int4_zero_points_past_15_are_refused_at_load_and_export(capsys, quantized, tmp_path, to):
    q = Path(shutil.copytree(quantized, tmp_path / "q"))
    edit_tensor(q / "model.safetensors", "model.layers.0.mlp.up_proj.zeros", lambda z: z.fill_(255))
    fails_cleanly(capsys, tmp_path, ["generate", "-m", q, "-p", "hi"], "up_proj", "zero point 255 is past int4's codes")
    out = tmp_path / ("out.gguf" if to == "gguf" else "out")
    fails_cleanly(capsys, tmp_path, ["export", q, "--to", to, "--out", out], "up_proj", "zero point 255")


@pytest.mark.parametrize("order", ["zeros", "negative"])
def test_an_input_order_that_is_no_permutation_is_refused(capsys, quantized, tmp_path, order):
    q = Path(shutil.copytree(quantized, tmp_path / "q"))
    tensors = load_file(q / "model.safetensors")
    K = {n.removesuffix(".qweight"): t.shape[1] * (2 if t.dtype == torch.uint8 else 1)  # int4: two codes a byte
         for n, t in tensors.items() if n.endswith(".qweight") and not n.startswith("model.embed_tokens")}
    for module, k in K.items():
        tensors[f"{module}.input_order"] = (torch.zeros(k, dtype=torch.int32) if order == "zeros"
                                            else -torch.arange(k, dtype=torch.int32))
    save_file(tensors, q / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((q / "config.json").read_text())
    config["quantization_config"].update(input_order=True, format_version=2)
    (q / "config.json").write_text(json.dumps(config))
    fails_cleanly(capsys, tmp_path, ["generate", "-m", q, "-p", "hi"], "input_order is not a permutation")
    fails_cleanly(capsys, tmp_path, ["export", q, "--to", "gptq", "--out", tmp_path / "gptq"],
                  "input_order is not a permutation")


def test_finite_weights_too_large_for_fp16_scales_are_refused(capsys, ckpt, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    edit_tensor(ckpt / "model.safetensors", name, lambda t: t.float().index_fill_(0, torch.tensor([0]), 3e38).to(t.dtype)
                if t.dtype == torch.float32 else t.index_fill_(0, torch.tensor([0]), 3e38))
    for bits in ("4", "8"):
        fails_cleanly(capsys, tmp_path, ["quantize", ckpt, "--bits", bits, "--group-size", "32", "--out", tmp_path / "q",
                                         "--no-report"],
                      name, "past the largest float16 scale")


@pytest.mark.parametrize("lie, needle", [(dict(head_count=0), "num_attention_heads must be positive"),
                                         (dict(rms_eps=float("nan")), "rms_norm_eps")])
def test_import_gguf_never_writes_a_checkpoint_qlite_refuses(capsys, tmp_path, lie, needle):
    write_tiny_gguf(tmp_path / "m.gguf", **lie)
    fails_cleanly(capsys, tmp_path, ["import-gguf", tmp_path / "m.gguf", tmp_path / "out"], "m.gguf", needle)
    assert not (tmp_path / "out").exists()


# signals: SIGTERM and SIGHUP clean up like Ctrl-C

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_termination_signals_leave_no_temp_dirs(pristine, tmp_path, sig):
    out = tmp_path / "q"
    proc = subprocess.Popen([sys.executable, "-m", "qlite", "quantize", str(pristine), "--out", str(out),
                             "--method", "gptq", "--nsamples", "4", "--seqlen", "64", "--group-size", "32"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.time() + 120
    while time.time() < deadline and not any(tmp_path.glob(".q.tmp-*")) and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("it finished before the signal")
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "error: interrupted", err
    assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == []


# 7. a few of the poor messages

def test_out_dot_names_the_flag(capsys, pristine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fails_cleanly(capsys, tmp_path, ["quantize", pristine, "--out", "."], "--out", "already exists")


def test_a_token_id_past_the_vocabulary_names_the_tokenizer(capsys, ckpt, tmp_path):
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok["model"]["vocab"]["<|far|>"] = 700  # in the vocabulary too, so the id stays 700
    tok["added_tokens"].append({"id": 700, "content": "<|far|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "a <|far|> b", "--raw"],
                  "tokenizer.json gave token id 700, past the model's vocab_size 512")


def test_a_file_size_limit_names_the_output_not_its_temp_dir(pristine, tmp_path):
    """EFBIG (ENOSPC alike) while writing: one line naming --out, nothing left behind."""
    out = tmp_path / "q"
    r = subprocess.run(["bash", "-c", f'ulimit -f 64 && exec "{sys.executable}" -m qlite quantize "{pristine}" '
                        f'--out "{out}" --group-size 32 --no-report'], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = one_line((r.returncode, r.stderr), f"--out {out}: cannot be written (File too large)")
    assert ".tmp-" not in line and sorted(tmp_path.iterdir()) == []


# the sweep: every side file as every kind of thing that is not a regular file inside the checkpoint

KINDS = ["fifo", "device", "link to /dev/zero", "link outside", "dangling link", "directory"]


def make_kind(path: Path, kind: str, secret: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 5))  # a /dev/zero of its own
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "link outside":
        path.symlink_to(secret)
    elif kind == "dangling link":
        path.symlink_to(path.parent / "nowhere" / "x")
    else:
        path.mkdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
@pytest.mark.parametrize("kind", KINDS)
def test_every_side_file_as_every_kind_of_non_file(capsys, pristine, tmp_path, secret, kind):
    """generate, info and quantize on a checkpoint with one side file (or the index) replaced: each
    run ends, within its alarm, in success (a file that command does not read) or one line naming that
    file; nothing outside is read, the checkpoint is unchanged."""
    from qlite.cli import main

    for name in [*SIDE_FILES, "model.safetensors.index.json"]:
        ckpt = Path(shutil.copytree(pristine, tmp_path / "ckpt", dirs_exist_ok=True))
        edit_json(ckpt / "tokenizer_config.json", chat_template=None)  # so chat_template.jinja is read
        make_kind(ckpt / name, kind, secret)
        before = {p.name: p.lstat().st_mode for p in ckpt.iterdir()}
        for args in (["generate", "-m", ckpt, "-p", "hi", "--max-new-tokens", "2"], ["info", ckpt],
                     ["quantize", ckpt, "--out", tmp_path / "q", "--group-size", "32", "--no-report"]):
            signal.alarm(60)  # a hang fails the test instead of the run
            try:
                code = main([str(a) for a in args])
            finally:
                signal.alarm(0)
            out, err = capsys.readouterr()
            assert "s3cr3t" not in out + err and "Traceback" not in err
            lines = [line for line in err.strip().splitlines() if line.strip() and "%|" not in line]
            if name == "config.json" or (name == "tokenizer.json" and args[0] == "generate"):
                assert code, (name, args[0], "must be read, so must fail")
            if code:
                assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0], (name, args[0], err)
            shutil.rmtree(tmp_path / "q", ignore_errors=True)
        assert {p.name: p.lstat().st_mode for p in ckpt.iterdir()} == before
        shutil.rmtree(ckpt)


@pytest.mark.parametrize("changes, needle", [
    (dict(do_sample="false"), "do_sample must be true or false, got 'false'"),
    (dict(do_sample=True, temperature="0.7"), "temperature must be a number, got '0.7'"),
    (dict(do_sample=True, top_k=5.5), "top_k must be an integer"),
    (dict(eos_token_id="263"), "eos_token_id must be an integer"),
])
def test_generation_config_values_are_never_coerced(capsys, ckpt, tmp_path, changes, needle):
    edit_json(ckpt / "generation_config.json", **changes)
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], "generation_config.json", needle)


def test_a_gguf_whose_vocabulary_lies_about_the_embedding_is_refused(capsys, tmp_path, monkeypatch):
    import gguf
    add_tokens, add_types = gguf.GGUFWriter.add_token_list, gguf.GGUFWriter.add_token_types
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_list", lambda self, t: add_tokens(self, [*t, "zz1", "zz2"]))
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_types", lambda self, t: add_types(self, [*t, 1, 1]))
    write_tiny_gguf(tmp_path / "m.gguf")  # two more tokens listed than the embedding has rows
    fails_cleanly(capsys, tmp_path, ["import-gguf", tmp_path / "m.gguf", tmp_path / "out"],
                  "tokenizer.ggml.tokens lists", "but token_embd.weight is")


def test_calibration_larger_than_memory_is_refused_up_front(capsys, pristine, tmp_path):
    fails_cleanly(capsys, tmp_path, ["quantize", pristine, "--method", "gptq", "--nsamples", "1000000000",
                                     "--seqlen", "128", "--group-size", "32", "--out", tmp_path / "q"],
                  "--nsamples 1000000000 --seqlen 128", "GiB this machine has available")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json"])
def test_deeply_nested_json_is_one_line(capsys, ckpt, tmp_path, name):
    (ckpt / name).write_text("[" * 100000 + "]" * 100000)
    fails_cleanly(capsys, tmp_path, ["generate", "-m", ckpt, "-p", "hi"], name, "nested too deeply")


def test_a_targets_entry_that_is_no_string_is_named(capsys, quantized, tmp_path):
    ct = tmp_path / "ct"
    ok(run("export", quantized, "--to", "compressed-tensors", "--out", ct))
    config = json.loads((ct / "config.json").read_text())
    next(iter(config["quantization_config"]["config_groups"].values()))["targets"] = [{"re": "x"}]
    (ct / "config.json").write_text(json.dumps(config))
    fails_cleanly(capsys, tmp_path, ["import", ct, "--out", tmp_path / "back"], "targets: target {'re': 'x'} is not a string")
