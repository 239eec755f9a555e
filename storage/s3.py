"""S3 or any S3-compatible store (MinIO, Ceph, moto) as storage.

``s3://bucket/prefix``; the endpoint comes from ``CLIPMILL_S3_ENDPOINT`` (or boto3's own
``AWS_ENDPOINT_URL``), credentials from boto3's standard chain. Large files go up in parts.
Every upload is verified: the object's size must match, and its ``sha256`` metadata (the
digest of what we sent) must be what we computed; single-part uploads are also checked by
S3 itself (``ChecksumSHA256``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import uuid

from clipmill.storage.base import StorageError, StorageUnavailable, check_key, sha256_file

MULTIPART_BYTES = 8 * 1024 * 1024


def parse_url(url: str) -> tuple[str, str]:
    if not url.startswith("s3://"):
        raise StorageError(f"{url!r}: not an s3:// URL")
    rest = url[5:]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StorageError(f"{url!r}: no bucket; write s3://bucket/prefix")
    return bucket, prefix.strip("/")


class S3Storage:
    def __init__(self, url: str, endpoint_url: str | None = None, client=None):
        import boto3
        from boto3.s3.transfer import TransferConfig

        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_url(url)
        self.endpoint = endpoint_url or os.environ.get("CLIPMILL_S3_ENDPOINT") or None
        self._own_client = client is None
        # a session of its own: credentials are looked up now, for this storage, never taken
        # from boto3's process-wide default session (which caches the first ones it found)
        self.session = boto3.session.Session()
        self.client = client or self.session.client("s3", endpoint_url=self.endpoint)
        self.transfer = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    def _key(self, key: str) -> str:
        key = check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def location(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def _verify(self, key: str, size: int, digest: str) -> str:
        head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        got_size, got_digest = head["ContentLength"], head.get("Metadata", {}).get("sha256")
        if got_size != size or got_digest != digest:
            raise StorageError(
                f"{self.location(key)}: upload not verified (size {got_size} vs {size}, sha256 {got_digest} vs {digest})"
            )
        return self.location(key)

    def put_bytes(self, key: str, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data, Metadata={"sha256": digest},
            ChecksumSHA256=base64.b64encode(bytes.fromhex(digest)).decode(),
        )
        return self._verify(key, len(data), digest)

    def put_file(self, key: str, path: str | os.PathLike) -> str:
        size, digest = os.path.getsize(path), sha256_file(path)
        self.client.upload_file(
            str(path), self.bucket, self._key(key), ExtraArgs={"Metadata": {"sha256": digest}}, Config=self.transfer
        )
        return self._verify(key, size, digest)

    def get_bytes(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def get_range(self, key: str, first: int, last: int) -> bytes:
        """Bytes ``first`` to ``last`` (inclusive) of an object, fetched alone (a browser seeking)."""
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={first}-{last}")["Body"].read()

    def stat(self, key: str) -> tuple[int, str | None] | None:
        """(size, sha256 from metadata) of an object, or None if it does not exist."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return head["ContentLength"], head.get("Metadata", {}).get("sha256")

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def check_writable(self) -> None:
        """The bucket is reachable with the credentials in use, and a probe object can be
        written and deleted under the prefix. Fails within seconds (short timeouts, one retry)
        with a one-line StorageUnavailable."""
        from botocore.config import Config

        client = self.client
        if self._own_client:
            client = self.session.client("s3", endpoint_url=self.endpoint, config=Config(
                connect_timeout=5, read_timeout=20, retries={"total_max_attempts": 2, "mode": "standard"}))
        probe = self._key(f".clipmill-probe-{uuid.uuid4().hex}")
        try:
            client.head_bucket(Bucket=self.bucket)
            client.put_object(Bucket=self.bucket, Key=probe, Body=b"")
            client.delete_object(Bucket=self.bucket, Key=probe)
        except Exception as e:  # noqa: BLE001 - botocore's errors, each said in one line
            raise StorageUnavailable(describe_error(e, self.bucket, self.endpoint)) from None


def describe_error(e: BaseException, bucket: str | None = None, endpoint: str | None = None) -> str:
    """One line for a boto3/botocore error: missing credentials, no such bucket, access denied,
    an unreachable endpoint."""
    from botocore.exceptions import (ClientError, EndpointConnectionError, NoCredentialsError,
                                     PartialCredentialsError)

    where = f"bucket {bucket!r}" if bucket else "S3"
    at = f" at {endpoint}" if endpoint else ""
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return (f"no S3 credentials found ({e}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE, or use an instance role")
    if isinstance(e, EndpointConnectionError):
        return f"cannot reach the S3 endpoint{at or ''} ({e})"
    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        if code in ("404", "NoSuchBucket", "NotFound"):
            return f"{where} does not exist{at}"
        if code in ("403", "AccessDenied", "Forbidden", "AllAccessDisabled"):
            return f"access to {where}{at} denied with the credentials in use"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
            return f"the S3 credentials in use were refused ({code})"
        return f"{where}{at}: {code or 'error'}: {err.get('Message') or e}"
    return f"{where}{at}: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
