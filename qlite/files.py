"""The one guarded way qlite reads a small file (config, index, tokenizer and its config, generation
config, chat template, reports; eval and calibration text named by the user): a regular file (not a
FIFO or a device: opened non-blocking and checked on the open descriptor, so nothing can hang),
of bounded size, UTF-8, every failure one line naming the file. A checkpoint's own files must also
lie inside the checkpoint dir once every link is resolved."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .errors import QliteError

MAX_BYTES = 256 * 2**20  # the largest small file read whole (a large vocabulary's tokenizer.json: ~10 MB)


def inside(path: Path, directory: Path) -> bool:
    """Whether path, links resolved, lies inside directory; or, for a Hugging Face cache snapshot
    (HUB/models--X/snapshots/REV/), is a file directly in its blobs dir (HUB/models--X/blobs, where
    the hub's own links point), when that blobs dir is a real dir and no link itself."""
    target, home = Path(path).resolve(), Path(directory).resolve()
    if home in target.parents:
        return True
    blobs = home.parent.parent / "blobs"
    return (home.parent.name == "snapshots" and target.parent == blobs and not blobs.is_symlink()
            and blobs.resolve() == blobs)


def open_regular(path: Path, within: Path | None = None):
    """A regular file opened for reading (binary): opened non-blocking (a FIFO cannot hang it) and
    checked on the descriptor; `within`: a dir the file must lie in, links resolved."""
    path = Path(path)
    if within is not None and (path.exists() or path.is_symlink()) and not inside(path, within):
        raise QliteError(f"{path}: links to {path.resolve()}, outside {within}; refusing to read it")
    try:
        fd = os.open(path.resolve() if within is not None else path,
                     os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise QliteError(f"{path}: not found") from None
    except IsADirectoryError:
        raise QliteError(f"{path}: is a directory, not a file") from None
    except PermissionError:
        raise QliteError(f"{path}: permission denied (it exists, but this user may not read it)") from None
    except OSError as e:
        raise QliteError(f"{path}: unreadable ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) \
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
        raise QliteError(f"{path}: is {kind}, not a regular file")
    return os.fdopen(fd, "rb")


def read_bytes(path: Path, within: Path | None = None, limit: int = MAX_BYTES) -> bytes:
    """A regular file's bytes (open_regular), at most `limit`."""
    with open_regular(path, within) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise QliteError(f"{path}: unreadable ({e.strerror})") from None
    if len(data) > limit:
        raise QliteError(f"{path}: larger than {limit / 2**20:g} MiB, more than a file of its kind can be")
    return data


def read_text(path: Path, within: Path | None = None, limit: int = MAX_BYTES) -> str:
    """read_bytes, decoded as UTF-8."""
    data = read_bytes(path, within, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QliteError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_json(path: Path, within: Path | None = None, limit: int = MAX_BYTES) -> dict:
    """A JSON object from a file: read_text, parsed, every failure naming the file."""
    try:
        value = json.loads(read_text(path, within, limit))
    except RecursionError:
        raise QliteError(f"{path}: not valid JSON (nested too deeply)") from None
    except json.JSONDecodeError as e:
        raise QliteError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise QliteError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def read_checkpoint_json(model_dir: Path, name: str) -> dict | None:
    """A checkpoint's JSON side file by name, read inside the dir; None when it is absent."""
    path = Path(model_dir) / name
    if not path.exists() and not path.is_symlink():
        return None
    return read_json(path, within=model_dir)
