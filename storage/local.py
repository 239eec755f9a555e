"""A local folder as storage. Every write goes to a temporary file in the same folder, is
flushed to disk, then renamed over the target, so readers never see half a file
(:func:`replacing` and :func:`write_atomic`, which the encoders and the training's checkpoints
use too)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from clipmill.storage.base import StorageUnavailable, check_key, sha256_file


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(path: Path) -> None:
    """Flush a rename in ``path`` to disk, where the folder can be opened and synced: a folder
    one may write but not list (mode 0333), a file system that cannot sync a folder (EINVAL)
    are left as they are; the file itself is on disk by then."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


TEMP_GLOB = ".clipmill-*.tmp"  # the temporary files of replacing: a killed writer leaves its own behind
_HOST = socket.gethostname().replace("-", "_")[:40] or "host"
STALE_AFTER = 600  # s unwritten: a writer in another pid namespace of the same host name is not seen


def abandoned(tmp: Path) -> bool:
    """Whether ``tmp``, a temporary file of :func:`replacing` (``.clipmill-HOST-PID-HEX.tmp``),
    was left by a process of this host that is gone, and has not been written for STALE_AFTER:
    no one will finish or remove it. A file of another host (a container, an NFS client) or of a
    running process, a link or a folder, is not."""
    try:
        _, host, pid, _ = tmp.name.split("-")
        if host != _HOST or tmp.is_symlink() or not tmp.is_file() or time.time() - tmp.stat().st_mtime < STALE_AFTER:
            return False
        os.kill(int(pid), 0)
    except (ValueError, OverflowError):
        return False  # not one of ours
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's process, running
    except OSError:
        return False  # gone already (its writer finished), or unreadable
    return False  # its writer is running


@contextmanager
def replacing(target: str | os.PathLike, follow_links: bool = True) -> Iterator[Path]:
    """A temporary file's path beside ``target`` (beside the file it links to, when it is a link
    and ``follow_links``; else the link itself is replaced) for the block to write: when the
    block ends the file is flushed to disk and renamed over the target, and the rename itself
    flushed; when it raises, the file is removed. So ``target`` is whole or as it was after a
    full disk, a crash of the process or of the machine, and a reader never sees half a file.
    The temporary name is short whatever the target's (a name near the file system's 255-byte
    limit) and names its writer (host and pid, :func:`abandoned`); the file gets the mode the
    writer's ``open`` gives it."""
    real = Path(os.path.realpath(target)) if follow_links else Path(os.path.abspath(target))
    tmp = real.with_name(f".clipmill-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, real)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_folder(real.parent)


def write_atomic(target: str | os.PathLike, fill: Callable[[BinaryIO], object]) -> None:
    """Write the file ``target`` whole or not at all: ``fill(f)`` writes the temporary file of
    :func:`replacing`. A link at ``target`` is replaced, not followed (a storage key never
    writes outside its root)."""
    with replacing(target, follow_links=False) as tmp, open(tmp, "xb") as f:
        fill(f)


class LocalStorage:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def location(self, key: str) -> str:
        return str(self.path(key))

    def _write(self, key: str, fill) -> str:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, fill)  # readable by all the umask allows: clips are served to reviewers
        return str(target)

    def put_bytes(self, key: str, data: bytes) -> str:
        return self._write(key, lambda f: f.write(data))

    def put_file(self, key: str, path: str | os.PathLike) -> str:
        def fill(f):
            with open(path, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)

        return self._write(key, fill)

    def get_bytes(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def get_range(self, key: str, first: int, last: int) -> bytes:
        with open(self.path(key), "rb") as f:
            f.seek(first)
            return f.read(max(0, last - first + 1))

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def stat(self, key: str) -> tuple[int, str | None] | None:
        """(size, sha256) of a stored file, or None if it does not exist."""
        p = self.path(key)
        if not p.is_file():
            return None
        return p.stat().st_size, sha256_file(p)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def check_writable(self) -> None:
        """Create the root if it is missing, write and delete a probe file in it; folders this
        check created are removed again, so a run refused later leaves nothing behind."""
        created = []
        p = self.root
        while not p.exists() and p != p.parent:
            created.append(p)
            p = p.parent
        if not p.is_dir():
            raise StorageUnavailable(f"{p} is a file, not a folder")
        try:
            for d in reversed(created):
                d.mkdir()
            fd, probe = tempfile.mkstemp(prefix=".clipmill-probe-", dir=self.root)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            where = e.filename or self.root
            raise StorageUnavailable(f"cannot write in {where} ({e.strerror or e})") from None
        finally:
            for d in created:  # deepest first
                try:
                    d.rmdir()
                except OSError:
                    pass
