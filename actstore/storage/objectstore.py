"""ObjectStorage: a store in an object store (s3://, gs://, az://) through obstore.

obstore (the Rust object_store crate) reads credentials, region and endpoint from the
providers' standard environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
AWS_ENDPOINT_URL, AWS_ALLOW_HTTP, GOOGLE_*, AZURE_*) and retries with backoff on 5xx,
throttling and dropped connections. A put is atomic and durable when it returns (large
objects go multipart by themselves); a create-only put is a conditional put
(If-None-Match: *). Objects cannot be appended to or truncated in place: `append` and
`truncate` rewrite the whole object (small metadata files only: a writer shard's block
records and checksums).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from actstore.errors import StorageAccessError
from actstore.storage.base import Entry, KeyNotFound, Storage, Writeback

UPLOAD_THREADS = 16  # concurrent background puts
UPLOAD_BUFFER_BYTES = 256 * 2**20  # bytes of background puts in memory at once (put waits beyond)

SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "azure://", "abfs://", "abfss://")


def _obstore():
    try:
        import obstore
    except ImportError:  # pragma: no cover - obstore is a declared dependency
        raise ImportError("stores in object storage need obstore: pip install obstore") from None
    return obstore


class ObjectStorage(Storage):
    """A store at an object-store URL (`s3://bucket/prefix`, `gs://...`, `az://...`).

    Args:
        url: the store's URL.
        store: an obstore store to use instead of one built from the URL (its root is
            the URL's bucket); for tests and custom credentials.
        client_options, retry_config: passed to obstore's `from_url`.
    """

    def __init__(self, url: str, *, client_options: dict | None = None, retry_config: dict | None = None):
        self.url = url.rstrip("/")
        self.local_root = None
        self._options = {k: v for k, v in {"client_options": client_options, "retry_config": retry_config}.items() if v}
        self._store = None
        self._uploads: _Uploads | None = None

    @property
    def store(self) -> Any:
        """The obstore store rooted at this URL (built on first use; not pickled)."""
        if self._store is None:
            self._store = _obstore().store.from_url(self.url, **self._options)
        return self._store

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_store"] = None
        state["_uploads"] = None
        return state

    def __repr__(self) -> str:
        return f"ObjectStorage({self.url!r})"

    def where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def child(self, prefix: str) -> ObjectStorage:
        return ObjectStorage(f"{self.url}/{prefix.strip('/')}", **self._options)

    coalesce_bytes = 1024 * 1024  # ranges of one object closer than this are read by one request

    def _missing(self, e: Exception, key: str) -> bool:
        return isinstance(e, FileNotFoundError)

    # ---- reads ----------------------------------------------------------------------
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        obs = _obstore()
        try:
            res = obs.get(self.store, key)
        except Exception as e:
            if self._missing(e, key):
                raise KeyNotFound(f"{self.where(key)} does not exist") from None
            raise
        if max_bytes is not None and res.meta["size"] > max_bytes:
            raise ValueError(f"{self.where(key)} has {res.meta['size']} bytes, more than the {max_bytes} allowed for it")
        return bytes(res.bytes())

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return bytes(self._range(key, start, length))

    def _range(self, key: str, start: int, length: int) -> Any:
        """`length` bytes from `start` (fewer at the end of the object), as obstore's buffer."""
        if length <= 0:
            return b""
        obs = _obstore()
        try:
            return obs.get_range(self.store, key, start=start, length=length)
        except FileNotFoundError:
            raise KeyNotFound(f"{self.where(key)} does not exist") from None
        except Exception:  # a range past the end of the object: answer with what there is
            size = self.size(key)
            if size is None:
                raise KeyNotFound(f"{self.where(key)} does not exist") from None
            end = min(start + length, size)
            if end == start + length:
                raise  # the range lies inside the object: a real failure
            return obs.get_range(self.store, key, start=start, end=end) if end > start else b""

    def read_into(self, key: str, dest: memoryview, offset: int = 0) -> int:
        try:
            data = self._range(key, offset, len(dest))
        except KeyNotFound:
            raise
        except Exception as e:  # the loaders' and readers' path: the project's error, naming the object
            raise self._read_failed(key, e) from e
        n = len(data)
        dest[:n] = memoryview(data)  # copy: the response into the caller's buffer
        return n

    def read_ranges_into(self, key: str, ranges: list[tuple[int, memoryview]]) -> list[int]:
        """One obstore `get_ranges`: ranges less than `coalesce_bytes` apart are fetched as one
        request (a window's (example, layer) ranges of a Zarr shard file: one GET), up to
        10 requests at once; a failure raises, after obstore's retries."""
        if len(ranges) < 2:
            return [self.read_into(key, dest, offset) for offset, dest in ranges]
        obs = _obstore()
        try:
            parts = obs.get_ranges(self.store, key, starts=[o for o, _ in ranges], lengths=[len(d) for _, d in ranges],
                                   coalesce=self.coalesce_bytes)
        except FileNotFoundError:
            raise KeyNotFound(f"{self.where(key)} does not exist") from None
        except Exception:  # e.g. a range past the end of the object: one by one, each answering short (or failing)
            return [self.read_into(key, dest, offset) for offset, dest in ranges]
        counts = []
        for (_, dest), part in zip(ranges, parts):
            n = min(len(part), len(dest))
            dest[:n] = memoryview(part)[:n]  # copy: the response into the caller's buffer
            counts.append(n)
        return counts

    def read_object(self, key: str, *, max_bytes: int) -> memoryview | None:
        try:
            res = _obstore().get(self.store, key)
            if res.meta["size"] > max_bytes:
                raise ValueError(f"{self.where(key)} has {res.meta['size']} bytes, more than the {max_bytes} expected")
            return memoryview(res.bytes())  # obstore's buffer: no copy
        except ValueError:
            raise
        except Exception as e:
            if self._missing(e, key):
                return None
            raise self._read_failed(key, e) from e

    def read_object_into(self, key: str, dest: memoryview) -> int | None:
        try:
            res = _obstore().get(self.store, key)
            data = res.bytes()
        except Exception as e:
            if self._missing(e, key):
                return None
            raise self._read_failed(key, e) from e
        n = min(len(data), len(dest))
        dest[:n] = memoryview(data)[:n]
        return len(data)

    def _read_failed(self, key: str, e: Exception) -> StorageAccessError:
        return StorageAccessError(f"cannot read {self.where(key)} (after obstore's retries): {_first_line(e)}")

    def size(self, key: str) -> int | None:
        try:
            return int(_obstore().head(self.store, key)["size"])
        except Exception as e:
            if self._missing(e, key):
                return None
            raise

    def list(self, prefix: str = "") -> Iterator[Entry]:
        full = prefix.strip("/")
        for batch in _obstore().list(self.store, (full + "/") if full else None):
            for meta in batch:
                yield Entry(meta["path"], int(meta["size"]), "file")

    def list_dir(self, prefix: str = "") -> list[str]:
        full = prefix.strip("/")
        res = _obstore().list_with_delimiter(self.store, (full + "/") if full else None)
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]}
        names.update(m["path"].rsplit("/", 1)[-1] for m in res["objects"])
        return sorted(names)

    # ---- writes ---------------------------------------------------------------------
    def put(self, key: str, *parts: Any, atomic: bool = True, durable: bool = False,
            writeback: Writeback | None = None, background: bool = False) -> None:
        """A whole-object put (always atomic in an object store). With background=True or
        atomic=False (objects nobody reads before a later commit names them) the put goes
        to background threads and returns at once (its bytes copied); `barrier` waits for
        them. Memory of queued puts is bounded (UPLOAD_BUFFER_BYTES)."""
        data = b"".join(memoryview(p).cast("B") for p in parts) if len(parts) != 1 or not isinstance(parts[0], bytes) else parts[0]
        if atomic and not background:
            _obstore().put(self.store, key, data)
            return
        if self._uploads is None:
            self._uploads = _Uploads(self)
        self._uploads.submit(key, data)

    def barrier(self) -> None:
        if self._uploads is not None:
            self._uploads.wait()

    def upload_stats(self) -> dict[str, int]:
        return self._uploads.stats() if self._uploads is not None else {"queued_bytes": 0, "uploaded_bytes": 0, "uploaded": 0}

    def put_stream(self, key: str, parts: Iterator[bytes]) -> None:
        """A multipart upload: the object appears only when every part is in."""
        _obstore().put(self.store, key, parts, max_concurrency=2)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """A conditional put (If-None-Match: *). When a retried create finds the object,
        the first try may have succeeded with its answer lost: the object then holds
        exactly `data` and the call succeeds (callers make `data` unique: a writer id)."""
        obs = _obstore()
        try:
            obs.put(self.store, key, data, mode="create")
            return True
        except (obs.exceptions.AlreadyExistsError, obs.exceptions.PreconditionError):
            try:
                return self.get(key) == bytes(data)
            except KeyNotFound:
                return False

    def append(self, key: str, data: bytes) -> int:
        try:
            old = self.get(key)
        except KeyNotFound:
            old = b""
        new = old + bytes(data)
        self.put(key, new)
        return len(new)

    def truncate(self, key: str, size: int) -> None:
        self.put(key, self.get_range(key, 0, size))

    def delete(self, key: str) -> None:
        try:
            _obstore().delete(self.store, key)
        except Exception as e:
            if not self._missing(e, key):
                raise

    def delete_prefix(self, prefix: str) -> None:
        keys = [e.key for e in self.list(prefix)]
        for i in range(0, len(keys), 1000):
            _obstore().delete(self.store, keys[i : i + 1000])

    def sync(self, prefix: str = "") -> None:
        """A finished put is durable in an object store: nothing to do."""

    # ---- access -------------------------------------------------------------------
    def check_access(self, *, write: bool) -> None:
        """Fail in seconds, naming the URL and the cause, when the store's bucket cannot be
        listed or (with write) written: a missing bucket, refused credentials or
        permissions, an unreachable endpoint. Uses short retries (not the long ones of
        data transfers), and a probe object that it deletes again."""
        import uuid
        from datetime import timedelta

        obs = _obstore()
        quick = {"max_retries": 2, "retry_timeout": timedelta(seconds=10), "init_backoff": timedelta(milliseconds=100),
                 "max_backoff": timedelta(seconds=2), "backoff_base": 2.0}
        try:
            store = obs.store.from_url(self.url, **{**self._options, "retry_config": quick})
        except Exception as e:  # a malformed URL or configuration
            raise StorageAccessError(f"cannot open {self.url}: {_first_line(e)}") from None
        what = "list"
        try:
            obs.list_with_delimiter(store, None)
            if write:
                what = "write to"
                probe = f".actstore-probe-{uuid.uuid4().hex}"
                obs.put(store, probe, b"probe")
                obs.delete(store, probe)
        except Exception as e:
            raise StorageAccessError(f"cannot {what} {self.url}: {_cause(e, self.url)}") from None

    # ---- zarr -----------------------------------------------------------------------
    def zarr_store(self, prefix: str, *, read_only: bool) -> Any:
        from zarr.storage import ObjectStore

        target = self.child(prefix) if prefix.strip("/") else self
        return ObjectStore(target.store, read_only=read_only)


class _Uploads:
    """Background puts of one ObjectStorage: a thread pool with bounded bytes in flight."""

    def __init__(self, owner: ObjectStorage):
        self.owner = owner
        self.pool = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="actstore-upload")
        self.cond = threading.Condition()
        self.queued = 0
        self.uploaded_bytes = 0
        self.uploaded = 0
        self.futures: list[Future] = []

    def submit(self, key: str, data: bytes) -> None:
        with self.cond:
            while self.queued and self.queued + len(data) > UPLOAD_BUFFER_BYTES:
                self.cond.wait()
            self.queued += len(data)
        self.futures.append(self.pool.submit(self._put, key, data))
        if len(self.futures) > 4 * UPLOAD_THREADS:
            self.futures = [f for f in self.futures if not f.done() or f.exception() is not None]

    def _put(self, key: str, data: bytes) -> None:
        try:
            _obstore().put(self.owner.store, key, data)
        finally:
            with self.cond:
                self.queued -= len(data)
                self.uploaded_bytes += len(data)
                self.uploaded += 1
                self.cond.notify_all()

    def wait(self) -> None:
        """Wait for every put so far; the first failure is raised (after all finished)."""
        futures, self.futures = self.futures, []
        errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]

    def stats(self) -> dict[str, int]:
        with self.cond:
            return {"queued_bytes": self.queued, "uploaded_bytes": self.uploaded_bytes, "uploaded": self.uploaded}


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _cause(e: Exception, url: str) -> str:
    """What an obstore error means for the user, with the fix."""
    import os

    text = str(e)
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
    if "NoSuchBucket" in text or ("404" in text and "list" in text.lower()):
        return f"the bucket {bucket!r} does not exist (create it first, or check the URL)"
    if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text or "401" in text:
        return ("the credentials were refused (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the "
                "provider's credential chain)")
    if "AccessDenied" in text or "403" in text or isinstance(e, PermissionError):
        return f"access denied: these credentials may not use {bucket!r} (check the bucket policy and IAM permissions)"
    if "error sending request" in text or "Connection refused" in text or "dns error" in text or "timed out" in text.lower():
        where = f"the endpoint {endpoint}" if endpoint else "the provider's endpoint"
        return f"{where} cannot be reached (check AWS_ENDPOINT_URL, the network, and AWS_ALLOW_HTTP for http://)"
    return _first_line(e)
