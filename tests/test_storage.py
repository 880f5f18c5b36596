"""The Storage contract (as zarr-python's StoreTests): one class of behaviours that every
Storage subclasses once - a local folder, S3 (moto), Azure (Azurite), GCS (fake-gcs-server)
and the caching Storage in front of each. ReadContract: get, range and vectored reads,
missing keys, listing, zarr reads, for objects placed with `seed`. WriteContract adds what a
writable storage does: put (exact, in parts when large), create-only put with one winner,
append / truncate / delete, sync, zarr writes. The caching Storage refuses writes
(test_storage_cache.py) and GCS's emulator takes no uploads from obstore (its objects are
seeded through its JSON API), so they run ReadContract only."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zarr

from actstore.errors import CorruptStoreError, UnsafePathError
from actstore.storage import KeyNotFound, LocalStorage, ObjectStorage, Storage, open_storage
from actstore.storage.cache import CachedStorage

MiB = 2**20


class ReadContract:
    """The reads every Storage serves. A subclass gives the `storage` fixture and `seed`."""

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError

    def seed(self, storage: Storage, key: str, data: bytes) -> None:
        """Place `data` at `key` (a writable storage: its own put)."""
        storage.put(key, data)

    def test_get_ranges_and_reads_into_buffers(self, storage):
        self.seed(storage, "a/b/c.bin", b"hello world")
        for _ in range(2):  # the second read: a cache's hit
            assert storage.get("a/b/c.bin") == b"hello world"
        assert storage.size("a/b/c.bin") == 11 and storage.exists("a/b/c.bin") and storage.kind("a/b/c.bin") == "file"
        assert storage.get_range("a/b/c.bin", 6, 5) == b"world"
        assert storage.get_range("a/b/c.bin", 9, 10) == b"ld"  # short at the end
        buf = bytearray(4)
        assert storage.read_into("a/b/c.bin", memoryview(buf), 2) == 4 and bytes(buf) == b"llo "
        big = bytearray(20)
        assert storage.read_object_into("a/b/c.bin", memoryview(big)) == 11 and bytes(big[:11]) == b"hello world"
        small = bytearray(3)
        assert storage.read_object_into("a/b/c.bin", memoryview(small)) == 11  # the size tells a wrong-sized object
        assert storage.read_object_into("nothing", memoryview(small)) is None
        with pytest.raises(ValueError, match="11 bytes, more than the 4 allowed"):
            storage.get("a/b/c.bin", max_bytes=4)

    def test_many_ranges_of_one_object(self, storage):
        """read_ranges_into: adjacent ranges (one preadv of several buffers on a local disk),
        gaps, one range reaching past the end (a short count), in the order given."""
        data = bytes(range(256)) * 40  # 10,240 bytes
        self.seed(storage, "f.bin", data)
        spans = [(0, 100), (100, 28), (128, 1000), (2000, 10), (2010, 5), (10_200, 100), (5000, 3)]
        bufs = [bytearray(n) for _, n in spans]
        counts = storage.read_ranges_into("f.bin", [(o, memoryview(b)) for (o, _), b in zip(spans, bufs)])
        assert counts == [100, 28, 1000, 10, 5, 40, 3]
        for (o, n), b, c in zip(spans, bufs, counts):
            assert bytes(b[:c]) == data[o : o + c]

    def test_missing_keys(self, storage):
        with pytest.raises(KeyNotFound) as ei:
            storage.get("no/such")
        assert isinstance(ei.value, FileNotFoundError) and "no/such does not exist" in str(ei.value)
        with pytest.raises(KeyNotFound, match="no/such does not exist"):
            storage.get_range("no/such", 0, 4)
        assert storage.size("no/such") is None and storage.kind("no/such") is None and not storage.exists("no/such")

    def test_listing_and_children(self, storage):
        for key, data in {"meta/log": b"abcd", "x/1": b"1", "x/y/2": b"22"}.items():
            self.seed(storage, key, data)
        assert sorted((e.key, e.size) for e in storage.list()) == [("meta/log", 4), ("x/1", 1), ("x/y/2", 2)]
        assert sorted(e.key for e in storage.list("x")) == ["x/1", "x/y/2"]
        assert storage.list_dir() == ["meta", "x"] and storage.list_dir("x") == ["1", "y"]
        assert storage.stored_bytes("x") >= 3
        child = storage.child("x")
        assert child.get("y/2") == b"22" and child.where("y/2").endswith("x/y/2")
        assert sorted(e.key for e in child.list()) == ["1", "y/2"]

    def test_zarr_reads_through_the_storage(self, storage, tmp_path):
        local = open_storage(tmp_path / "made")
        _zarr_array(local.zarr_store("arr", read_only=False))
        for e in local.list():
            self.seed(storage, e.key, local.get(e.key))
        back = zarr.open_array(store=storage.zarr_store("arr", read_only=True), mode="r")
        assert (back[:] == np.arange(12, dtype="<f2").reshape(4, 3)).all()


class WriteContract(ReadContract):
    """A writable Storage: the writes the writer and the commit protocol rely on."""

    def test_put_joins_its_parts(self, storage):
        storage.put("a/b/c.bin", b"hello ", memoryview(b"world"))
        assert storage.get("a/b/c.bin") == b"hello world"
        storage.put("a/b/c.bin", b"replaced")  # a put replaces the whole object
        assert storage.get("a/b/c.bin") == b"replaced" and storage.size("a/b/c.bin") == 8

    def test_large_puts_of_several_parts_are_exact(self, storage):
        """A put larger than MULTIPART_BYTES goes up in parts (read from the caller's buffers,
        never joined); the object is the exact concatenation, and a smaller one too."""
        from actstore.storage.objectstore import MULTIPART_BYTES

        rng = np.random.default_rng(0)
        big = rng.integers(0, 256, 2 * MULTIPART_BYTES + 12345, dtype=np.uint8)
        index = rng.integers(0, 256, 4100, dtype=np.uint8).tobytes()
        storage.put("shards/c/0", memoryview(big), index)
        assert storage.get("shards/c/0") == big.tobytes() + index
        assert (
            storage.get_range("shards/c/0", MULTIPART_BYTES - 3, 10)
            == big[MULTIPART_BYTES - 3 : MULTIPART_BYTES + 7].tobytes()
        )
        storage.put("small", memoryview(big[:1000]), b"tail")
        assert storage.get("small") == big[:1000].tobytes() + b"tail"

    def test_put_if_absent_has_one_winner(self, storage):
        wins = []
        barrier = threading.Barrier(8)

        def claim(i: int) -> None:
            barrier.wait()
            if storage.put_if_absent("claim.json", f"writer {i}".encode()):
                wins.append(i)

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1
        assert storage.get("claim.json") == f"writer {wins[0]}".encode()
        assert not storage.put_if_absent("claim.json", b"late")  # taken: the object is unchanged
        assert storage.get("claim.json") == f"writer {wins[0]}".encode()

    def test_append_truncate_delete_and_sync(self, storage):
        assert storage.append("meta/log", b"abc") == 3
        assert storage.append("meta/log", b"de") == 5
        storage.truncate("meta/log", 4)
        assert storage.get("meta/log") == b"abcd"
        storage.put("x/1", b"1")
        storage.put("x/y/2", b"22")
        storage.delete("x/1")
        storage.delete("no/such")  # not an error
        assert sorted(e.key for e in storage.list()) == ["meta/log", "x/y/2"]
        storage.delete_prefix("x")
        assert [e.key for e in storage.list()] == ["meta/log"] and not storage.exists("x/y/2")
        for i in range(3):
            storage.put(f"d/{i}", b"d")
        storage.delete_many(["d/0", "d/2", "d/none"])  # one request on an object store; a missing key is no error
        assert sorted(e.key for e in storage.list("d")) == ["d/1"]
        storage.delete("d/1")
        storage.sync()
        assert storage.get("meta/log") == b"abcd"

    def test_zarr_through_the_storage(self, storage):
        _zarr_array(storage.zarr_store("arr", read_only=False))
        back = zarr.open_array(store=storage.zarr_store("arr", read_only=True), mode="r")
        assert (back[:] == np.arange(12, dtype="<f2").reshape(4, 3)).all()
        assert storage.exists("arr/zarr.json") and storage.exists("arr/c/1/0")


def _zarr_array(store) -> None:
    """A 4x3 float16 zarr v3 array of 0..11 in two chunks, written to `store`."""
    arr = zarr.create_array(store=store, shape=(4, 3), chunks=(2, 3), dtype="<f2", compressors=None, zarr_format=3)
    arr[:] = np.arange(12, dtype="<f2").reshape(4, 3)


class TestLocalStorage(WriteContract):
    @pytest.fixture
    def storage(self, tmp_path):
        return open_storage(tmp_path / "store")


class TestS3Storage(WriteContract):
    @pytest.fixture
    def storage(self, s3_url):
        return open_storage(s3_url)


class TestAzureStorage(WriteContract):
    @pytest.fixture
    def storage(self, az_url):
        return open_storage(az_url)


class TestGCSStorage(ReadContract):
    @pytest.fixture
    def storage(self, gs_url):
        return open_storage(gs_url)

    def seed(self, storage, key, data):
        import emulators

        emulators.gcs_put(storage, key, data)


class Cached:
    """The caching Storage in front of an inner one (every key cacheable); objects are seeded
    through the inner storage, as a finalized store's are."""

    @pytest.fixture
    def storage(self, inner, tmp_path):
        return CachedStorage(inner, tmp_path / "cache", max_bytes=64 * MiB, namespace="n", cacheable=lambda k: True)

    def seed(self, storage, key, data):
        Cached.put_inner(storage.inner, key, data)

    @staticmethod
    def put_inner(inner: Storage, key: str, data: bytes) -> None:
        if inner.url.startswith("gs://"):
            import emulators

            emulators.gcs_put(inner, key, data)
        else:
            inner.put(key, data)


class TestCachedLocalStorage(Cached, ReadContract):
    @pytest.fixture
    def inner(self, tmp_path):
        return open_storage(tmp_path / "store")


class TestCachedS3Storage(Cached, ReadContract):
    @pytest.fixture
    def inner(self, s3_url):
        return open_storage(s3_url)


class TestCachedAzureStorage(Cached, ReadContract):
    @pytest.fixture
    def inner(self, az_url):
        return open_storage(az_url)


class TestCachedGCSStorage(Cached, ReadContract):
    @pytest.fixture
    def inner(self, gs_url):
        return open_storage(gs_url)


def test_open_storage_kinds(tmp_path):
    assert isinstance(open_storage(tmp_path), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    assert open_storage(f"file://{tmp_path}").local_root == tmp_path
    assert isinstance(open_storage("s3://bucket/prefix"), ObjectStorage)
    with pytest.raises(ValueError, match=r"ftp://h/x: unknown URL scheme 'ftp'"):
        open_storage("ftp://h/x")


def test_local_refuses_links_fifos_and_folders(tmp_path):
    import os

    s = open_storage(tmp_path / "s")
    s.put("real", b"x")
    os.symlink(tmp_path / "s" / "real", tmp_path / "s" / "link")
    os.mkfifo(tmp_path / "s" / "fifo")
    (tmp_path / "s" / "dir").mkdir()
    with pytest.raises(UnsafePathError, match="link is a symbolic link; actstore never writes links inside a store"):
        s.get("link")
    with pytest.raises(
        CorruptStoreError, match=r"fifo is a FIFO \(named pipe\) where a file belongs; the store is damaged"
    ):
        s.get("fifo")  # never blocks
    with pytest.raises(CorruptStoreError, match="dir is a folder where a file belongs"):
        s.get("dir")
    assert {e.key: e.kind for e in s.list()} == {"real": "file", "link": "link", "fifo": "other", "dir": "dir"}
    with pytest.raises(UnsafePathError, match="points outside the store"):
        s.get("../etc/passwd")


def test_check_access_names_the_cause(s3_endpoint, tmp_path, monkeypatch):
    from actstore.errors import StorageAccessError

    open_storage(tmp_path / "new" / "store").check_access(write=True)  # creatable: fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageAccessError, match="it is a file, not a folder"):
        open_storage(tmp_path / "file").check_access(write=True)
    with pytest.raises(
        StorageAccessError, match=r"cannot list s3://no-such-bucket/x: the bucket 'no-such-bucket' does not exist"
    ):
        open_storage("s3://no-such-bucket/x").check_access(write=True)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(StorageAccessError, match=r"the endpoint http://127.0.0.1:9 cannot be reached"):
        open_storage("s3://some-bucket/x").check_access(write=False)
