"""An exclusive lock held by one process at a time through a lock file: the nightly run's on a
SQLite job table (``jobs.farm.nightly``) and ``clipmill train-model``'s on its checkpoint folder.

A POSIX ``flock`` on the file, taken without waiting: a second process is refused at once. The
lock goes when its holder ends or dies (the kernel drops it with the process), so a killed run
never leaves a stale lock behind; the file itself stays, and only the lock on it matters. The
holder writes ``pid N on HOST`` into it, for the message a refused process prints.
"""

from __future__ import annotations

import fcntl  # POSIX: clipmill runs on Linux and macOS
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


def holder_of(fd: int) -> str:
    """Who holds the lock on the open lock file ``fd``, as that process wrote it."""
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not written its pid yet"


@contextmanager
def exclusive_lock(path: Path, busy: Callable[[str], Exception]) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if missing, with its folder) for the
    ``with`` block. When another process holds it, raise ``busy(holder)`` at once, ``holder``
    being what that process wrote (``pid N on HOST``).

    A holder may remove the file while it still holds the lock (a folder it made and leaves
    empty): a process that opened the file before that and gets the lock after it finds the path
    gone or another file there, and tries again on the path as it is now."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = holder_of(fd)
            os.close(fd)
            raise busy(holder) from None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the file this process locked was removed by its last holder: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())  # who holds it, for people
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
