"""Writing outputs so that faults lose nothing: every file is written under a temporary name tied to it
(`.NAME.partial-PID` beside it) and renamed when complete, free space is checked before the work when the size is
known, and the operating system's write failures become one-line errors naming the output.

A SIGKILLed run cannot remove its temporary file; the next run to the same output removes it (its process is gone)
or says that another live process is writing the same output (the last rename wins; neither leaves a broken file).
Scratch folders (a sweep's base logits: gigabytes for a large vocabulary) are held under a lock for their life;
the next run to make one removes those whose lock no process holds.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ikquant.errors import OutputError
from ikquant.sizes import format_size

#: errno -> what a user is told; other OS errors are not a user's mistake we can name, and keep their traceback
KNOWN_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit reached",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or folder",
    errno.ENOTDIR: "a part of the path is not a folder",
    errno.EISDIR: "is a folder",
}
_PARTIAL = re.compile(r"\.(?P<name>.+)\.partial-(?P<pid>\d+)")
#: a scratch folder's name: iktools-WHAT-PID-RANDOM (tempfile.mkdtemp's random part has no dash)
_SCRATCH = re.compile(r"iktools-(?P<what>.+)-(?P<pid>\d+)-[^-]+")
#: the lock file that marks a scratch folder in use, and how long a folder may go without one (between mkdtemp
#: and the lock's creation) before it counts as abandoned
SCRATCH_LOCK = ".in-use"
SCRATCH_UNLOCKED_GRACE_S = 600.0


def partial_path(path: Path) -> Path:
    """The temporary name `path` is written under until it is complete."""
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


def output_of(path: Path) -> Path:
    """The output a temporary name belongs to (`path` itself when it is not one)."""
    m = _PARTIAL.fullmatch(path.name)
    return path.with_name(m.group("name")) if m else path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare_output(path: Path, nbytes: int | None = None) -> None:
    """Before writing `path`: its folder must exist, leftovers of killed runs are removed (a live writer of the
    same output is reported), and `nbytes` (when known) must fit the free space."""
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise OutputError(f"{path}: the folder {folder} does not exist")
    for other in folder.glob(f".{path.name}.partial-*"):
        m = _PARTIAL.fullmatch(other.name)
        if m is None or int(m.group("pid")) == os.getpid():
            continue
        pid = int(m.group("pid"))
        if _alive(pid):
            print(f"warning: {other} is being written by another process (pid {pid}) to the same output; the last "
                  "to finish replaces the other's file", file=sys.stderr)
        else:
            other.unlink(missing_ok=True)
            print(f"note: removed {other}, left by a run that was killed (pid {pid})", file=sys.stderr)
    if nbytes is not None:
        require_space(path, nbytes)


def require_space(path: Path, nbytes: int) -> None:
    free = shutil.disk_usage(Path(path).parent).free
    if nbytes > free:
        raise OutputError(f"{path}: needs {format_size(nbytes)}, but only {format_size(free)} are free on its file "
                          "system")


def os_error_message(exc: OSError, path: Path | None = None) -> str | None:
    """The one-line message for an OS error a user can act on (None: not one of those), naming the output rather
    than its temporary name."""
    reason = KNOWN_ERRNOS.get(exc.errno) if exc.errno is not None else None
    if reason is None and exc.errno is None and re.search(r"\d+ requested and \d+ written", str(exc)):
        reason = f"the write stopped short: no space left on the device, or a file size limit ({exc})"  # no errno
    if reason is None:
        return None
    where = path if path is not None else output_of(Path(exc.filename)) if exc.filename else None
    return f"{where}: {reason}" if where is not None else reason


@contextmanager
def write_errors(path: Path) -> Iterator[None]:
    """OS failures while writing `path` as OutputErrors naming it."""
    try:
        yield
    except OSError as exc:
        message = os_error_message(exc, Path(path))
        if message is None:
            raise
        raise OutputError(message) from None


@contextmanager
def output_file(path: Path, nbytes: int | None = None) -> Iterator[Path]:
    """A temporary name to write `path` under: prepared (prepare_output), renamed into place when the block ends
    without an exception, removed otherwise."""
    path = Path(path)
    tmp = partial_path(path)
    prepare_output(path, nbytes)
    try:
        with write_errors(path):
            yield tmp
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _abandoned(folder: Path) -> bool:
    """Whether no process holds `folder`'s lock. A lock dies with its process, whatever the process namespace (a
    pid alone could be reused, or belong to a container sharing the folder)."""
    try:
        fd = os.open(folder / SCRATCH_LOCK, os.O_RDWR)
    except FileNotFoundError:
        try:
            return time.time() - folder.stat().st_mtime > SCRATCH_UNLOCKED_GRACE_S
        except FileNotFoundError:
            return False
    except OSError:  # another user's folder: not ours to judge or remove
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def remove_abandoned_scratch(under: Path) -> None:
    """Remove the scratch folders under `under` that killed runs left (SIGKILL, the OOM killer), saying so."""
    for folder in Path(under).glob("iktools-*"):
        m = _SCRATCH.fullmatch(folder.name)
        if m is None or not folder.is_dir() or folder.is_symlink() or not _abandoned(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            print(f"note: removed {folder}, left by a run that was killed (pid {m.group('pid')})", file=sys.stderr)


@contextmanager
def scratch_folder(what: str, under: Path | None = None) -> Iterator[Path]:
    """A folder for temporary files under `under` (the system's temporary folder by default), removed when the
    block ends however it ends; first, folders that killed runs left there are removed. A run killed inside the
    block leaves this one behind for the next run to remove."""
    base = Path(under) if under is not None else Path(tempfile.gettempdir())
    remove_abandoned_scratch(base)
    with write_errors(base):
        folder = Path(tempfile.mkdtemp(prefix=f"iktools-{what}-{os.getpid()}-", dir=base))
    fd = None
    try:
        with write_errors(folder):
            fd = os.open(folder / SCRATCH_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if fd is not None:
            os.close(fd)
