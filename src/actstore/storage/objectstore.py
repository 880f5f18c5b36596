"""ObjectStorage: a store in an object store (s3://, gs://, az://) through obstore.

obstore (the Rust object_store crate) reads credentials, region and endpoint from the
providers' standard environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
AWS_ENDPOINT_URL, AWS_ALLOW_HTTP, GOOGLE_*, AZURE_*) and retries with backoff on 5xx,
throttling and some dropped connections; every read and every idempotent write is also
retried on the connection-level failures obstore does not retry (`storage/retry.py`). A
put is atomic and durable when it returns (large objects go multipart by themselves); a create-only put is a conditional put
(If-None-Match: *). Objects cannot be appended to or truncated in place: `append` and
`truncate` rewrite the whole object (small metadata files only: a writer shard's block
records and checksums).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from actstore.errors import StorageAccessError
from actstore.storage import forksafe
from actstore.storage.base import Entry, KeyNotFound, Storage, Writeback
from actstore.storage.objecterrors import cause as _cause
from actstore.storage.objecterrors import first_line as _first_line
from actstore.storage.objecterrors import translated, translating_object_store
from actstore.storage.retry import call as retry_call
from actstore.storage.retry import retried, root_of

MULTIPART_BYTES = 8 * 2**20  # objects larger than this go up in parts of this size
MULTIPART_CONCURRENCY = 8  # parts of one object in flight at once

SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "azure://", "abfs://", "abfss://")


def _obstore(url: str = "an object store"):
    """obstore, refused (ForkedClientError) in a child forked after this process used it."""
    return forksafe.obstore_for(url)


PROVIDER_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "AZURITE_")


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
        self._pid = os.getpid()
        # The provider settings obstore reads from the environment, as this process sees them:
        # a worker started by spawn or forkserver (whose server keeps the environment of when
        # it started) builds its client with the same ones (__setstate__).
        self._env = {k: v for k, v in os.environ.items() if k.startswith(PROVIDER_ENV_PREFIXES)}

    @property
    def store(self) -> Any:
        """The obstore store rooted at this URL (built on first use; not pickled)."""
        obs = _obstore(self.url)
        if self._store is None or self._pid != os.getpid():  # a fresh client in each process
            self._store, self._pid = obs.store.from_url(self.url, **self._options), os.getpid()
        return self._store

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_store"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for k, v in state.get("_env", {}).items():  # what the worker's own environment does not say
            os.environ.setdefault(k, v)

    def __repr__(self) -> str:
        return f"ObjectStorage({self.url!r})"

    def where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def child(self, prefix: str) -> ObjectStorage:
        return ObjectStorage(f"{self.url}/{prefix.strip('/')}", **self._options)

    coalesce_bytes = 1024 * 1024  # ranges of one object closer than this are read by one request

    def _missing(self, e: Exception, key: str) -> bool:
        return isinstance(e, FileNotFoundError) and "NoSuchBucket" not in str(e)

    # ---- reads ----------------------------------------------------------------------
    @translated("read")
    @retried("read")
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        obs = _obstore(self.url)
        try:
            res = obs.get(self.store, key)
        except Exception as e:
            if self._missing(e, key):
                raise KeyNotFound(f"{self.where(key)} does not exist") from None
            raise
        if max_bytes is not None and res.meta["size"] > max_bytes:
            raise ValueError(
                f"{self.where(key)} has {res.meta['size']} bytes, more than the {max_bytes} allowed for it"
            )
        return bytes(res.bytes())

    @translated("read")
    @retried("read")
    def get_range(self, key: str, start: int, length: int) -> bytes:
        return bytes(self._range(key, start, length))

    def _range(self, key: str, start: int, length: int) -> Any:
        """`length` bytes from `start` (fewer at the end of the object), as obstore's buffer."""
        if length <= 0:
            return b""
        obs = _obstore(self.url)
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

    @translated("read")
    @retried("read")
    def read_into(self, key: str, dest: memoryview, offset: int = 0) -> int:
        data = self._range(key, offset, len(dest))
        n = len(data)
        dest[:n] = memoryview(data)  # copy: the response into the caller's buffer
        return n

    @translated("read")
    @retried("read")
    def read_ranges_into(self, key: str, ranges: list[tuple[int, memoryview]]) -> list[int]:
        """One obstore `get_ranges`: ranges less than `coalesce_bytes` apart are fetched as one
        request (a window's (example, layer) ranges of a Zarr shard file: one GET), up to
        10 requests at once; a failure raises, after obstore's retries."""
        if len(ranges) < 2:
            return [self.read_into(key, dest, offset) for offset, dest in ranges]
        obs = _obstore(self.url)
        try:
            parts = obs.get_ranges(
                self.store,
                key,
                starts=[o for o, _ in ranges],
                lengths=[len(d) for _, d in ranges],
                coalesce=self.coalesce_bytes,
            )
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

    @translated("read")
    @retried("read")
    def read_object(self, key: str, *, max_bytes: int) -> memoryview | None:
        try:
            res = _obstore(self.url).get(self.store, key)
            if res.meta["size"] > max_bytes:
                raise ValueError(f"{self.where(key)} has {res.meta['size']} bytes, more than the {max_bytes} expected")
            return memoryview(res.bytes())  # obstore's buffer: no copy
        except ValueError:
            raise
        except Exception as e:
            if self._missing(e, key):
                return None
            raise

    @translated("read")
    @retried("read")
    def read_object_into(self, key: str, dest: memoryview) -> int | None:
        try:
            res = _obstore(self.url).get(self.store, key)
            data = res.bytes()
        except Exception as e:
            if self._missing(e, key):
                return None
            raise
        n = min(len(data), len(dest))
        dest[:n] = memoryview(data)[:n]
        return len(data)

    @translated("read")
    @retried("read")
    def size(self, key: str) -> int | None:
        try:
            return int(_obstore(self.url).head(self.store, key)["size"])
        except Exception as e:
            if self._missing(e, key):
                return None
            raise

    def list(self, prefix: str = "") -> Iterator[Entry]:
        yield from self._list(prefix)  # whole, then yielded: a listing cut midway is listed again

    @translated("list")
    @retried("list")
    def _list(self, prefix: str) -> list[Entry]:
        full = prefix.strip("/")
        return [
            Entry(meta["path"], int(meta["size"]), "file")
            for batch in _obstore(self.url).list(self.store, (full + "/") if full else None)
            for meta in batch
        ]

    @translated("list")
    @retried("list")
    def list_dir(self, prefix: str = "") -> list[str]:
        full = prefix.strip("/")
        res = _obstore(self.url).list_with_delimiter(self.store, (full + "/") if full else None)
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]}
        names.update(m["path"].rsplit("/", 1)[-1] for m in res["objects"])
        return sorted(names)

    # ---- writes ---------------------------------------------------------------------
    @translated("write")
    @retried("write")
    def put(
        self, key: str, *parts: Any, atomic: bool = True, durable: bool = False, writeback: Writeback | None = None
    ) -> None:
        """A whole-object put: always atomic and durable in an object store. An object of
        more than MULTIPART_BYTES goes up in parts of that size, MULTIPART_CONCURRENCY at a
        time, read straight from the caller's buffers (no copy of the whole); a smaller
        one is one request."""
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)
        if total > MULTIPART_BYTES:
            _obstore(self.url).put(
                self.store, key, views, chunk_size=MULTIPART_BYTES, max_concurrency=MULTIPART_CONCURRENCY
            )
        else:
            _obstore(self.url).put(
                self.store, key, views[0] if len(views) == 1 else b"".join(views), use_multipart=False
            )

    @translated("write")
    def put_stream(self, key: str, parts: Iterator[bytes]) -> None:
        """A multipart upload: the object appears only when every part is in."""
        _obstore(self.url).put(self.store, key, parts, max_concurrency=2)

    @translated("write")
    @retried("write")
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """A conditional put (If-None-Match: *). When a retried create finds the object,
        the first try may have succeeded with its answer lost: the object then holds
        exactly `data` and the call succeeds (callers make `data` unique: a writer id)."""
        obs = _obstore(self.url)
        try:
            obs.put(self.store, key, data, mode="create")
            return True
        except (obs.exceptions.AlreadyExistsError, obs.exceptions.PreconditionError):
            try:
                return self.get(key) == bytes(data)
            except KeyNotFound:
                return False

    @translated("write")
    def append(self, key: str, data: bytes) -> int:
        try:
            old = self.get(key)
        except KeyNotFound:
            old = b""
        new = old + bytes(data)
        self.put(key, new)
        return len(new)

    @translated("write")
    def truncate(self, key: str, size: int) -> None:
        self.put(key, self.get_range(key, 0, size))

    @translated("delete")
    @retried("delete")
    def delete(self, key: str) -> None:
        try:
            _obstore(self.url).delete(self.store, key)
        except Exception as e:
            if not self._missing(e, key):
                raise

    def delete_prefix(self, prefix: str) -> None:
        self.delete_many([e.key for e in self.list(prefix)])  # (each step translated and retried)

    @translated("delete")
    @retried("delete")
    def delete_many(self, keys: list[str]) -> None:
        """Remove objects, up to 1000 per request (a missing one is not an error)."""
        for i in range(0, len(keys), 1000):
            part = keys[i : i + 1000]
            try:
                _obstore(self.url).delete(self.store, part)
            except Exception as e:
                if not self._missing(e, part[0]):
                    raise
                for key in part:  # a service that fails a batch holding a missing key (Azure): one by one
                    self.delete(key)

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

        obs = _obstore(self.url)
        quick = {
            "max_retries": 2,
            "retry_timeout": timedelta(seconds=10),
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=2),
            "backoff_base": 2.0,
        }
        try:
            store = obs.store.from_url(self.url, **{**self._options, "retry_config": quick})
        except Exception as e:  # a malformed URL or configuration
            raise StorageAccessError(f"cannot open {self.url}: {_first_line(e)}") from None
        what = "list"
        root = root_of(self.url)
        try:  # connection resets are retried (retry.call): the endpoint answered; a refusal is not
            retry_call(
                lambda: obs.list_with_delimiter(store, None), what=what, where=self.url, root=root, deadline_s=20
            )
            if write:
                what = "write to"
                probe = f".actstore-probe-{uuid.uuid4().hex}"
                retry_call(lambda: obs.put(store, probe, b"probe"), what=what, where=self.url, root=root, deadline_s=20)
                retry_call(lambda: obs.delete(store, probe), what=what, where=self.url, root=root, deadline_s=20)
        except StorageAccessError:
            raise
        except Exception as e:
            raise StorageAccessError(f"cannot {what} {self.url}: {_cause(e, self.url)}") from None

    # ---- zarr -----------------------------------------------------------------------
    def zarr_store(self, prefix: str, *, read_only: bool) -> Any:
        target = self.child(prefix) if prefix.strip("/") else self
        zs = translating_object_store()(target.store, read_only=read_only)
        zs.url = target.url
        return zs
