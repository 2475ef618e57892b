"""The one way qlite writes an output: into a temporary place beside it, moved into place only when
complete. An output dir being written is claimed by a lock on its temporary dir (held until the
process ends, so a killed run's claim lapses by itself): a second run into the same output is
refused while the first lives, and what a dead run left behind is removed by the next one.

A dir is taken for a dead run's leftover only with proof that a qlite run made it for this output:
its name (.NAME.tmp-* or .NAME.old-*), a marker file inside naming the output and the run, and no
live lock. A user's own dir of such a name (a source moved there, say) is never touched."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from .errors import QliteError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; outputs are still written atomically
    fcntl = None


def check_not_input(dst: Path, inputs, flag: str) -> None:
    """An output (dir or file) is a path the OS takes (no NUL byte), none of the inputs, no dir that holds
    one, and not inside one."""
    if "\0" in str(dst):
        raise QliteError(f"{flag} {str(dst)!r}: a path cannot hold a NUL byte"[:300])
    here = Path(dst).resolve()
    for given in inputs:
        path = Path(given).expanduser().resolve()
        where = ("is" if here == path else "holds" if here in path.parents else
                 "lies inside" if path in here.parents else None)
        if where is not None:
            raise QliteError(f"{flag} {dst}: {where} the input {path}; choose another output")


def check_output(dst: Path, force: bool, inputs=(), flag: str = "--out") -> None:
    """An output dir may be written where nothing is, or, with --force, over a checkpoint dir (one
    with config.json) that holds none of the inputs: never an input itself, a dir above one or a
    place inside one, never a plain file, a dir that is not a checkpoint, or the current dir. Errors
    name the flag."""
    dst = Path(dst)
    check_not_input(dst, inputs, flag)
    if not dst.exists() and not dst.is_symlink():
        return
    if not force:
        raise QliteError(f"{flag} {dst}: already exists (use --force to replace it)")
    if dst.is_symlink() or not dst.is_dir() or not (dst / "config.json").is_file():
        raise QliteError(f"{flag} {dst}: --force replaces only a checkpoint dir (one with config.json), and this is "
                         "not one")
    if dst.resolve() == Path.cwd().resolve():
        raise QliteError(f"{flag} {dst}: is the current dir, which cannot be replaced; write elsewhere")


def _lock(path: Path) -> int | None:
    """An exclusive lock on the dir `path` (its fd, kept open while held), or None if another
    process holds it."""
    fd = os.open(path, os.O_RDONLY)
    if fcntl is None:
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


MARKER = ".qlite-run"  # in every temporary dir qlite makes: {"output": NAME, "run": ID}


def mark(directory: Path, dst: Path) -> None:
    """Write the proof that `directory` is a qlite run's temporary dir for the output dst."""
    run = f"{os.getpid()}-{uuid.uuid4().hex}"
    (directory / MARKER).write_text(json.dumps({"output": dst.name, "run": run}))


def _marked_for(directory: Path, dst: Path) -> bool:
    marker = directory / MARKER
    if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 4096:
        return False
    try:
        proof = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(proof, dict) and proof.get("output") == dst.name and isinstance(proof.get("run"), str)


def _leftovers(dst: Path) -> list[Path]:
    """Temporary dirs of qlite runs writing dst: .NAME.tmp-* (being written), .NAME.old-* (being
    replaced), each a real dir with this output's marker inside."""
    return sorted(p for pattern in (f".{dst.name}.tmp-*", f".{dst.name}.old-*") for p in dst.parent.glob(pattern)
                  if p.is_dir() and not p.is_symlink() and _marked_for(p, dst))


def _claim_leftovers(dst: Path) -> None:
    """Refuse if a live run is writing dst; clear what dead runs left (their locks lapsed): a run
    killed halfway through replacing dst left the old dst in its .old- dir, which goes back in place."""
    for path in _leftovers(dst):
        fd = _lock(path)
        if fd is None:
            raise QliteError(f"{dst}: another qlite run is writing it (into {path.name}); wait for it to end")
        try:
            previous = path / REPLACED
            if previous.is_dir() and not previous.is_symlink() and not dst.exists() and not dst.is_symlink():
                os.rename(previous, dst)
                print(f"qlite: put {dst} back in place, from an interrupted run that was replacing it", file=sys.stderr)
            shutil.rmtree(path)
            print(f"qlite: removed {path}, left by an interrupted run", file=sys.stderr)
        except OSError as e:
            raise QliteError(f"{path}: left by an interrupted run and cannot be removed ({e.strerror})") from None
        finally:
            os.close(fd)


def _claimed_dir(dst: Path, kind: str) -> tuple[Path, int]:
    """A new dir .NAME.KIND-XXXX beside dst, marked and locked before it takes that name: made under
    a name no other run looks at, then renamed, so a .tmp- or .old- dir is locked while its run lives."""
    new = Path(tempfile.mkdtemp(prefix=f".{dst.name}.new-", dir=dst.parent))
    mark(new, dst)
    fd = _lock(new)
    claimed = new.with_name(new.name.replace(".new-", f".{kind}-", 1))
    os.rename(new, claimed)
    return claimed, fd


REPLACED = "replaced"  # inside an .old- dir: the output being replaced, until the new one is in place


@contextlib.contextmanager
def atomic_output_dir(dst: Path, force: bool = False, inputs=(), flag: str = "--out"):
    """Yield a temporary dir beside dst, claimed by this process; on success it replaces dst, on any
    failure it is removed. dst is checked first (check_output) and again before the move, so a dir
    that appeared meanwhile is never replaced without --force."""
    check_output(dst, force, inputs, flag)
    dst = Path(os.path.abspath(dst))  # "out/.." or "." has no name to put beside it
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where a parent dir should be, no permission, ...
        raise QliteError(f"{flag} {dst}: cannot make its directory {dst.parent} ({e.strerror or e})") from None
    _claim_leftovers(dst)
    tmp, fd = _claimed_dir(dst, "tmp")
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary dir
    try:
        yield tmp
        check_output(dst, force, inputs, flag)
        if dst.exists():
            old, old_fd = _claimed_dir(dst, "old")
            try:
                os.rename(dst, old / REPLACED)
                os.rename(tmp, dst)
                shutil.rmtree(old, ignore_errors=True)
            finally:
                os.close(old_fd)
        else:
            os.rename(tmp, dst)
        (dst / MARKER).unlink()  # the proof stays with the temporary dir until it is the output
    except OSError as e:  # no space, too big, no permission: blamed on the output, not its temporary name
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(e, tmp, f"{flag} {dst}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def write_error(e: OSError, tmp: Path, output: str) -> QliteError:
    """An OSError met while writing into tmp, as one line naming the output (or the file it was
    about, when that is not in tmp: a source that vanished, say)."""
    name = str(e.filename or "")
    reason = e.strerror or str(e)
    if e.errno is None and re.search(r"\d+ requested and \d+ written", reason):  # numpy's tofile, short
        reason = "no space left on the device: a write stopped short"
    if not name or name.startswith(str(tmp)):
        return QliteError(f"{output}: cannot be written ({reason})")
    return QliteError(f"{name}: {reason}")


@contextlib.contextmanager
def atomic_output_file(path: Path, flag: str = "--out"):
    """Yield a temporary file path beside `path`; on success it replaces `path`, on failure it is
    removed: the file is whole or untouched. Errors name `flag` and the path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent if str(path.parent) else ".")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise write_error(e, Path(tmp), f"{flag} {path}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_file_atomic(path: Path, text: str, flag: str = "--out") -> None:
    """Write text to path through a temporary file beside it: the file is whole or untouched."""
    with atomic_output_file(path, flag) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_output_file(dst: Path, force: bool, magic: bytes, inputs=()) -> None:
    """An output file may be written where nothing is, or, with --force, over a regular file that
    starts with `magic` (a file of the kind being written) and is none of the inputs."""
    dst = Path(dst)
    check_not_input(dst, inputs, "--out")
    if not dst.parent.is_dir():
        raise QliteError(f"{dst}: its directory {dst.parent} does not exist")
    if not dst.exists() and not dst.is_symlink():
        return
    if not force:
        raise QliteError(f"{dst}: already exists (use --force to replace it)")
    if dst.is_symlink() or not dst.is_file() or dst.open("rb").read(len(magic)) != magic:
        raise QliteError(f"{dst}: --force replaces only a file of the kind written ({magic!r}), and this is not one")


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
