"""Session fixtures: tiny random checkpoints (see tiny_models.py); torch's threads split between test workers."""
import os
from pathlib import Path

import pytest

from tiny_models import CONFIGS, make_checkpoint


def pytest_configure(config):
    """Under pytest-xdist (pyproject's `-n`), each worker takes its share of the cores, for torch and the native
    kernels (which use torch's count) and for the subprocesses tests start (OMP_NUM_THREADS): two workers of
    two threads each would run four on two cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def tiny_variant(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, make_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", **CONFIGS[name])


def isas_here() -> list[str]:
    from qlite import native
    return native.isas_here()


@pytest.fixture(params=isas_here())
def native_isa(request, monkeypatch):
    """Each instruction set's native kernels this CPU runs, in turn (QLITE_NATIVE_ISA, as a user forces it)."""
    from qlite import native
    monkeypatch.setenv("QLITE_NATIVE_ISA", request.param)
    native.library.cache_clear()
    yield request.param
    monkeypatch.delenv("QLITE_NATIVE_ISA")
    native.library.cache_clear()


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The real demo model (Qwen2.5-Coder-0.5B-Instruct from its GGUF), fetched once and cached."""
    from qlite.demo import default_demo_dir, fetch_demo
    return fetch_demo(default_demo_dir())


@pytest.fixture(scope="session")
def demo_gguf(demo_dir) -> Path:
    from qlite.demo import fetch_gguf
    return fetch_gguf()


@pytest.fixture(scope="session")
def demo_int8(demo_dir, tmp_path_factory) -> Path:
    from quantize.convert import convert
    return convert(demo_dir, tmp_path_factory.mktemp("demo") / "int8", bits=8, group_size=None,
                   progress=False, report=False).out_dir


@pytest.fixture(scope="session")
def demo_int4(demo_dir, tmp_path_factory) -> Path:
    from quantize.convert import convert
    # no fidelity report (a minute of CI on an AVX2-only machine, and no test reads it here: tests/quantize/
    # test_report.py checks the report against eval on tiny models)
    return convert(demo_dir, tmp_path_factory.mktemp("demo") / "int4-g128", bits=4, group_size=128,
                   progress=False, report=False).out_dir


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """Each test leaves torch's thread count as it found it. The eval scripts' functions set it for their
    process (torch.set_num_threads), as their command lines should; called in-process by a test, one left
    every later test of the session on 1 thread (tests/eval/benchmarks/test_speculation.py's table, then
    test_target_bpw_keeps_the_demo_within_its_budget: 114 s, against 82 s with the count restored)."""
    import torch
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
