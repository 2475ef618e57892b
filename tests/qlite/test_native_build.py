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
