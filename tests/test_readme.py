"""The README's commands run, in its order, on a tiny random checkpoint (SRC; MODEL is its default
quantization, SRC-q4): what a user pastes works. Not run here: the fresh-machine setup lines (CI runs
them), `qlite serve` and its curl (a server that stays up: tests/qlite/serve/test_server.py serves)."""
import io
import re
import shlex
from pathlib import Path

from qlite.cli import main
from tiny_models import make_checkpoint

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_RUN = ("qlite serve", "curl ")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def commands() -> list[str]:
    lines = [line.strip() for block in blocks("sh") for line in block.splitlines()]
    return [part.strip() for line in lines for part in line.split("&&")
            if part.strip().startswith("qlite ") and not part.strip().startswith(NOT_RUN)]


def test_the_readme_names_its_commands():
    found = {c.split()[1] for c in commands()}
    assert {"generate", "chat", "quantize", "eval", "info", "export", "import"} <= found
    assert len(README.read_text().splitlines()) <= 250


def test_every_readme_command_runs_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    # whole GGUF blocks for the export; head_dim 32, as a quantized KV cache takes
    src = make_checkpoint(tmp_path / "SRC", intermediate_size=128, hidden_size=128)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hello\n/exit\n")))
    assert main(["quantize", str(src)]) == 0, capsys.readouterr().err  # the default recipe: SRC-q4
    assert (tmp_path / "SRC-q4" / "config.json").exists()
    for command in commands():
        args = [a.replace("SRC", str(src)) for a in shlex.split(command)[1:]]
        args = [str(tmp_path / "SRC-q4") if a == "MODEL" else a for a in args]
        if args[0] == "quantize" and args[1:] == [str(src)]:
            continue  # made above
        if args[0] in ("generate", "chat"):
            args += ["--max-new-tokens", "4"]
        if args[0] == "eval":
            args += ["--ctx", "128"]  # the tiny model's context is 256
        code = main(args)
        assert code == 0, f"{command}: {capsys.readouterr().err}"


def test_the_readme_python_runs(tiny_ckpt, tmp_path):
    [code] = blocks("python")
    target = tmp_path / "SRC-q4"
    assert main(["quantize", str(tiny_ckpt), "--out", str(target), "--no-report"]) == 0
    code = code.replace('"~/.cache/qlite/qwen2.5-coder-0.5b-instruct-q4"', repr(str(target)))
    code = code.replace("seed=1)", "seed=1, max_new_tokens=4)").replace('"What is a KV cache?"}])',
                                                                      '"What is a KV cache?"}], max_new_tokens=4)')
    exec(compile(code, "README.md", "exec"), {})
