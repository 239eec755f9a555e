"""Where clips, posters and sidecar JSON live."""

from __future__ import annotations

from clipmill.storage.base import Storage, StorageError, StorageUnavailable, check_key
from clipmill.storage.local import LocalStorage


def open_storage(url: str) -> Storage:
    """Storage for an ``--out`` or ``--to`` value: a local folder, or ``s3://bucket/prefix``."""
    if not url.strip():
        raise StorageError(f"{url!r}: an empty path; give a folder (e.g. ./delivery) or s3://bucket/prefix")
    if url.startswith("s3://"):
        from clipmill.storage.s3 import S3Storage

        return S3Storage(url)
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise StorageError(f"{url!r}: {scheme}:// storage is not supported; give a local folder or s3://bucket/prefix")
    return LocalStorage(url)


__all__ = ["Storage", "StorageError", "StorageUnavailable", "LocalStorage", "check_key", "open_storage"]
