"""Outputs appear whole or not at all; a live run's output is claimed; dead runs' leftovers go."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qlite.errors import QliteError
from qlite.outputs import atomic_output_dir, mark, write_file_atomic


def write_checkpoint_into(dst: Path) -> None:
    with atomic_output_dir(dst) as tmp:
        (tmp / "config.json").write_text("{}")


def test_second_run_into_the_same_output_is_refused_while_the_first_lives(tmp_path):
    dst = tmp_path / "out"
    with atomic_output_dir(dst) as tmp:
        (tmp / "config.json").write_text("{}")
        with pytest.raises(QliteError, match="another qlite run is writing it"):
            write_checkpoint_into(dst)
        with pytest.raises(QliteError, match="another qlite run"):
            write_checkpoint_into(dst)  # with --force too: the claim is not the output
    assert (dst / "config.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_killed_runs_temp_dir_is_named_and_removed_by_the_next_run(tmp_path, capfd):
    dst = tmp_path / "out"
    killed = ("import os, sys; from qlite.outputs import atomic_output_dir\n"
              f"with atomic_output_dir({str(dst)!r}) as tmp:\n"
              "    (tmp / 'big').write_bytes(b'x' * 1000); os._exit(9)\n")  # dies holding it
    assert subprocess.run([sys.executable, "-c", killed]).returncode == 9
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(left) == 1 and (left[0] / "big").exists()
    write_checkpoint_into(dst)
    assert f"removed {left[0]}, left by an interrupted run" in capfd.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_leftover_of_a_replace_is_removed_too(tmp_path):
    dst = tmp_path / "out"
    (tmp_path / ".out.old-12345").mkdir()
    mark(tmp_path / ".out.old-12345", dst)  # as a killed run's, after the new output was in place
    (tmp_path / ".out.old-12345" / "config.json").write_text("{}")
    (tmp_path / ".other.tmp-1").mkdir()  # another output's: not ours to touch
    mark(tmp_path / ".other.tmp-1", tmp_path / "other")
    write_checkpoint_into(dst)
    assert sorted(os.listdir(tmp_path)) == [".other.tmp-1", "out"]


@pytest.mark.parametrize("name", [".out.old-1", ".out.tmp-mine", ".out.tmp-x"])
def test_a_dir_named_like_a_leftover_without_a_runs_marker_is_never_touched(tmp_path, name):
    """mv SRC .m.old-1 && qlite quantize .m.old-1 --out m once deleted SRC: the name is no proof."""
    mine = tmp_path / name
    mine.mkdir()
    (mine / "weights").write_bytes(b"precious")
    if name.endswith("-x"):  # a marker naming another output is no proof either
        mark(mine, tmp_path / "elsewhere")
    write_checkpoint_into(tmp_path / "out")
    assert (mine / "weights").read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == sorted([name, "out"])


def test_a_run_killed_while_replacing_its_output_leaves_it_to_be_put_back(tmp_path, capfd):
    dst = tmp_path / "out"
    write_checkpoint_into(dst)
    killed = ("import os; from pathlib import Path; import qlite.outputs as o\n"
              "real = os.rename\n"
              "def rename(a, b):\n"
              "    real(a, b)\n"
              "    if Path(b).name == o.REPLACED: os._exit(9)\n"  # dst moved aside, the new one not yet in place
              "os.rename = rename\n"
              f"with o.atomic_output_dir(Path({str(dst)!r}), force=True) as tmp:\n"
              "    (tmp / 'config.json').write_text('new')\n")
    assert subprocess.run([sys.executable, "-c", killed]).returncode == 9
    assert not dst.exists()
    write_checkpoint_into(tmp_path / "other")  # another output's run leaves it alone
    assert not dst.exists()
    with pytest.raises(QliteError, match="already exists"):  # put back, so no --force: no replace
        write_checkpoint_into(dst)
    assert f"put {dst} back in place" in capfd.readouterr().err
    assert (dst / "config.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["other", "out"]


def test_force_replaces_a_checkpoint_and_leaves_nothing_beside_it(tmp_path):
    dst = tmp_path / "out"
    write_checkpoint_into(dst)
    with atomic_output_dir(dst, force=True) as tmp:
        (tmp / "config.json").write_text('{"new": 1}')
    assert (dst / "config.json").read_text() == '{"new": 1}'
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_file_atomic(path, 123)  # cannot be written: nothing half-written, no temp left
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["results.json"]
    write_file_atomic(path, "new")
    assert path.read_text() == "new" and oct(path.stat().st_mode & 0o777) != "0o600"
