"""Where clips, posters and sidecar JSON live."""

from __future__ import annotations

from storage.base import Storage, StorageError, check_key
from storage.local import LocalStorage


def open_storage(url: str) -> Storage:
    """Storage for a ``--out`` value: a local folder path."""
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise StorageError(f"--out {url!r}: {scheme}:// storage is not supported yet; give a local folder")
    return LocalStorage(url)


__all__ = ["Storage", "StorageError", "LocalStorage", "check_key", "open_storage"]
