"""The storage interface: clips, posters and sidecars under string keys like ``batch/job/a1.mp4``."""

from __future__ import annotations

import hashlib
import os
import posixpath
from typing import Protocol


class StorageError(ValueError):
    """A key or location that storage refuses."""


class StorageUnavailable(StorageError):
    """Storage that cannot be reached or written: missing credentials, no such bucket, a
    folder that cannot be created or written. A setup problem, not a job's own failure."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_key(key: str) -> str:
    """A key is a relative POSIX path with no '..', '.', empty or absolute parts."""
    if not key or key.startswith("/") or "\\" in key:
        raise StorageError(f"storage key {key!r}: must be a relative path with '/' separators")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"storage key {key!r}: empty, '.' and '..' parts are not allowed")
    return posixpath.normpath(key)


class Storage(Protocol):
    def put_bytes(self, key: str, data: bytes) -> str:
        """Write ``data`` at ``key`` atomically; returns the location (path or URL)."""

    def put_file(self, key: str, path: str) -> str:
        """Copy a local file to ``key`` atomically; returns the location."""

    def get_bytes(self, key: str) -> bytes: ...

    def get_range(self, key: str, first: int, last: int) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def stat(self, key: str) -> tuple[int, str | None] | None:
        """(size, sha256) of what is stored at ``key``, or None if nothing is."""

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    def location(self, key: str) -> str:
        """Where ``key`` lives, for people and sidecars: a path or a URL."""

    def check_writable(self) -> None:
        """Write and delete a probe under the root; StorageUnavailable (one line) if that fails."""
