"""What an object store's failure means for the user: obstore's errors as StorageAccessError.

Every ObjectStorage operation goes through `translated`: refused credentials, denied
permissions, a missing bucket, an unreachable endpoint or a request that failed after
obstore's retries become one StorageAccessError that names the URL, the operation and
the cause with its fix, instead of a Rust error dump. zarr-python's reads and writes of a
store in object storage go through `TranslatingObjectStore` for the same reason, which also
retries them on connection failures (`storage/retry.py`). A
missing key is not a failure: the operations answer it themselves (KeyNotFound, None).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

from actstore.errors import ActstoreError, StorageAccessError
from actstore.storage import retry

_STATUS = re.compile(r"status code: (\d{3})")


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def cause(e: BaseException, url: str) -> str:
    """What an obstore error means for the user, with the fix."""
    text = str(e)
    bucket = url.split("://", 1)[1].split("/", 1)[0] if "://" in url else url
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
    status = _STATUS.search(text)
    code = int(status.group(1)) if status else None  # not any "404" in the text: timings ("in 404.2ms") hold digits too
    if "NoSuchBucket" in text or (code == 404 and "list" in text.lower()):
        return f"the bucket {bucket!r} does not exist (create it first, or check the URL)"
    if (
        "InvalidAccessKeyId" in text
        or "SignatureDoesNotMatch" in text
        or code == 401
        or type(e).__name__ == "UnauthenticatedError"
    ):
        return (
            "the credentials were refused (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the "
            "provider's credential chain)"
        )
    if "AccessDenied" in text:
        return f"access denied: these credentials may not do this in {bucket!r} (check the bucket policy and IAM permissions)"
    if code == 403 or isinstance(e, PermissionError) or type(e).__name__ == "PermissionDeniedError":
        return (
            f"access denied: the credentials were refused or may not do this in {bucket!r} (check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, the bucket policy and IAM permissions)"
        )
    k = retry.kind(e)
    if k is not None and retry.root_of(url) in retry.reached():  # it answered before: not the configuration
        return (
            f"the connection failed ({retry.ONE[k]}: {retry.last_cause(e)}) although the endpoint answered "
            "before: the network or the server failed, not the configuration; try again"
        )
    if (
        "builder error" in text
        and endpoint
        and endpoint.startswith("http://")
        and os.environ.get("AWS_ALLOW_HTTP", "").lower() != "true"
    ):
        return (
            f"the endpoint {endpoint} is plain http, which obstore refuses unless AWS_ALLOW_HTTP=true is set "
            "(nothing was sent or retried): export AWS_ALLOW_HTTP=true, or use an https:// endpoint"
        )
    if (
        "error sending request" in text
        or "Connection refused" in text
        or "dns error" in text
        or "timed out" in text.lower()
    ):
        where = f"the endpoint {endpoint}" if endpoint else "the provider's endpoint"
        return f"{where} cannot be reached (check AWS_ENDPOINT_URL, the network, and AWS_ALLOW_HTTP for http://)"
    retried = "after " in text and " retries" in text
    return f"the request failed{' after retries' if retried else ''}: {first_line(e)}"


def _is_store_error(e: BaseException) -> bool:
    """An error of obstore (or of the network under it), not of the caller or of actstore."""
    if isinstance(e, ActstoreError):
        return False
    if isinstance(e, FileNotFoundError):
        return "NoSuchBucket" in str(e)
    mod = type(e).__module__ or ""
    return mod.startswith("obstore") or isinstance(e, (ConnectionError, TimeoutError, PermissionError))


def access_error(e: BaseException, what: str, where: str, url: str) -> StorageAccessError | None:
    """The StorageAccessError for an obstore failure of `what` on `where`, else None."""
    if not _is_store_error(e):
        return None
    return StorageAccessError(f"cannot {what} {where}: {cause(e, url)}")


def translated(what: str) -> Callable:
    """Decorate an ObjectStorage method (first argument: a key): obstore failures become
    StorageAccessError naming the object's URL (generators: while they are iterated)."""

    def deco(fn: Callable) -> Callable:
        def translate(e: Exception, self: Any, args: tuple) -> None:
            """Raise `e` as StorageAccessError when it is an obstore failure; else return."""
            err = access_error(
                e, what, self.where(args[0]) if args and isinstance(args[0], str) else self.url, self.url
            )
            if err is not None:
                raise err from None

        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen(self: Any, *args: Any, **kw: Any) -> Any:
                try:
                    yield from fn(self, *args, **kw)
                except Exception as e:
                    translate(e, self, args)
                    raise

            return gen

        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kw: Any) -> Any:
            try:
                return fn(self, *args, **kw)
            except Exception as e:
                translate(e, self, args)
                raise

        return call

    return deco


_ZARR_STORE = None


def translating_object_store() -> type:
    """zarr's ObjectStore whose failures are StorageAccessError naming the URL (built on
    first use: zarr imports slowly). Set `url` on the instance."""
    global _ZARR_STORE
    if _ZARR_STORE is not None:
        return _ZARR_STORE
    from zarr.storage import ObjectStore

    class TranslatingObjectStore(ObjectStore):
        url = "object store"

        async def get(self, key, prototype, byte_range=None):  # noqa: D102
            return await self._translate("read", key, lambda: ObjectStore.get(self, key, prototype, byte_range))

        async def get_partial_values(self, prototype, key_ranges):  # noqa: D102
            key_ranges = list(key_ranges)  # tried again as a whole: not an iterator used up by the first try
            return await self._translate(
                "read", "", lambda: ObjectStore.get_partial_values(self, prototype, key_ranges)
            )

        async def exists(self, key):  # noqa: D102
            return await self._translate("read", key, lambda: ObjectStore.exists(self, key))

        async def set(self, key, value):  # noqa: D102
            return await self._translate("write", key, lambda: ObjectStore.set(self, key, value))

        async def delete(self, key):  # noqa: D102
            return await self._translate("delete", key, lambda: ObjectStore.delete(self, key))

        async def set_if_not_exists(self, key, value):  # noqa: D102
            return await self._translate("write", key, lambda: ObjectStore.set_if_not_exists(self, key, value))

        async def delete_dir(self, prefix):  # noqa: D102
            return await self._translate("delete", prefix, lambda: ObjectStore.delete_dir(self, prefix))

        async def getsize(self, key):  # noqa: D102
            return await self._translate("read", key, lambda: ObjectStore.getsize(self, key))

        def list(self):  # noqa: D102
            return self._listed("", lambda: ObjectStore.list(self))

        def list_prefix(self, prefix):  # noqa: D102
            return self._listed(prefix, lambda: ObjectStore.list_prefix(self, prefix))

        def list_dir(self, prefix):  # noqa: D102
            return self._listed(prefix, lambda: ObjectStore.list_dir(self, prefix))

        async def _listed(self, prefix: str, make: Any) -> Any:
            """A listing collected whole, then yielded: one cut midway is listed again."""

            async def collect() -> list:
                return [x async for x in make()]

            for x in await self._translate("list", prefix, collect):
                yield x

        async def _translate(self, what: str, key: str, make: Any) -> Any:
            """`make()`'s coroutine, retried on connection failures (`retry.acall`), its
            failure as StorageAccessError naming the object."""
            where = f"{self.url}/{key}" if key else self.url
            try:
                return await retry.acall(make, what=what, where=where, root=retry.root_of(self.url))
            except Exception as e:
                err = access_error(e, what, where, self.url)
                if err is None:
                    raise
                raise err from None

    _ZARR_STORE = TranslatingObjectStore
    return _ZARR_STORE
