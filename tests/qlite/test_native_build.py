"""native.py builds its kernels on the user's machine and falls back to torch's where it cannot, so a kernel file
that stops compiling would only show as test_native.py's tests skipped: here, where the CPU runs an instruction
set and a C compiler is found, its kernel file must build and load."""
import os
import shutil
import subprocess

import pytest

from qlite import native


@pytest.mark.parametrize("isa", sorted(native.ISAS))
def test_each_kernel_file_this_cpu_runs_builds_and_loads(isa, tmp_path):
    needs, source, flags = native.ISAS[isa]
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not needs <= native.cpu_flags() or compiler is None:
        pytest.skip(f"no {isa} CPU or no C compiler here")
    try:
        path = native.build(compiler, native.CSRC / source, flags, tmp_path)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"{source} does not build: {e.stderr.decode()[-3000:]}")
    assert native.load(path, isa) is not None


def test_a_kernel_file_that_does_not_build_gives_way_to_the_next_instruction_set(monkeypatch):
    """A compiler without a flag an instruction set needs (GCC before 11: -mavxvnni): the next one the CPU runs
    loads, unless that one was forced."""
    runs = native.isas_here()
    if not runs or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no instruction set of qlite's kernels or no C compiler here")
    monkeypatch.setattr(native, "ISAS", {"unbuildable": (set(), "kernels_avx2.c", ["-mno-such-option"]), **native.ISAS})
    monkeypatch.delenv("QLITE_NATIVE_ISA", raising=False)
    native.library.cache_clear()
    try:
        assert native.isa() == "unbuildable" and native.library().isa == runs[0]
        monkeypatch.setenv("QLITE_NATIVE_ISA", "unbuildable")
        native.library.cache_clear()
        assert native.library() is None
    finally:
        native.library.cache_clear()
