"""ShardReader: lazily opened handles of one published writer shard, through its Storage.

Checks counts against the commit record and the array metadata before anything is
allocated, reads raw chunks through ChunkIO where the metadata allows it and through
zarr-python otherwise, and keeps per-sample arrays and text offsets once read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from actstore import catalog
from actstore.chunkio import ChunkIO, crc32c
from actstore.errors import ActstoreError, CorruptChunkError, CorruptStoreError, StoreNotFoundError
from actstore.layout import jsonio, keys, records, spec, texts
from actstore.layout.arraymeta import array_problems, chunk_rows
from actstore.layout.arrays import array_specs, every_chunk
from actstore.layout.chunks import (
    EMPTY,
    ChunkGeometry,
    array_meta_key,
    declared,
    geometry_from_metadata,
    key_scheme,
    row_chunk_key,
)
from actstore.layout.config import SegmentSpec, StoreConfig
from actstore.layout.records import ShardEntry
from actstore.read.batched import MappedChunk, map_chunks, read_many
from actstore.storage import KeyNotFound, LocalStorage, Storage
from actstore.storage.mapping import FileRegion

# A read of one (example, layer, segment) larger than this first confirms that the chunk
# data it covers exist on disk (raw layouts), so that metadata claiming absurd token counts
# cannot make a reader allocate what no file holds.
UNCHECKED_READ_BYTES = 64 * 2**20


class ShardReader:
    """One writer shard listed in the manifest.

    Args:
        storage: the store's Storage.
        entry: the shard's manifest entry.
        cfg: the store configuration.
        check_reads: check every activation read against the writer's crc32c of its
            (example, segment, layer) (`ActStore(path, verify="reads")`); the fast paths
            that copy from the page cache without a read (read_mapped, read_cached,
            map_chunks) then decline, and a read of fewer rows than the padded segment
            reads the rest to check it.
    """

    def __init__(self, storage: Storage, entry: ShardEntry, cfg: StoreConfig, *, check_reads: bool = False):
        self.check_reads = check_reads
        self._el_crcs: np.ndarray | None = None
        self.storage = catalog.shard_storage(storage, entry.name)
        self.where = self.storage.url
        self.entry = entry
        self.cfg = cfg
        try:  # one GET: on an object store, an existence check first would be a request more
            self.commit = catalog.read_commit(self.storage)
        except CorruptStoreError:
            if self.storage.kind(keys.COMMIT) is None and not self.storage.list_dir():
                raise StoreNotFoundError(
                    f"shard {entry.name} listed in the manifest of {storage.url} is missing (holds examples "
                    f"{entry.start}..{entry.start + entry.n_examples - 1}); shards present: "
                    f"{[keys.shard_name(n) for n in catalog.shard_numbers(storage)]}"
                ) from None
            raise
        committed = self.commit.n_committed  # counts are checked before anything is allocated
        if committed < entry.n_examples:
            raise CorruptStoreError(
                f"shard {self.where} has committed {committed} examples but the manifest says {entry.n_examples}; "
                "the manifest does not belong to these shards (run `actstore verify`)"
            )
        self.io: dict[str, ChunkIO | None] = {}
        self._zarr: dict[str, Any] = {}
        self._lengths: dict[str, np.ndarray] = {}
        self._per_sample: dict[str, np.ndarray] = {}
        self._text_offsets: dict[str, np.ndarray] = {}
        self._rows_checked = False
        self._specs = array_specs(cfg)
        self._backed: set[str] = set()
        self._zkeys: dict[str, tuple[int, str, list[int] | None]] = {}  # zarr-read arrays: how chunks are named
        try:
            consolidated = catalog.consolidated_arrays(self.storage, cfg.zarr_format)
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # untrusted JSON: any shape
            raise CorruptStoreError(f"shard {self.where} has damaged consolidated metadata ({e!r})") from None
        for seg in cfg.segments:
            self.io[seg.name] = self._open_acts(seg, consolidated)

    @property
    def geometries(self) -> dict[str, ChunkGeometry | None]:
        return {name: (io.geo if io is not None else None) for name, io in self.io.items()}

    def _open_acts(self, seg: SegmentSpec, consolidated: dict[str, Any] | None) -> ChunkIO | None:
        cfg = self.cfg
        rel = keys.acts_array(seg.name)
        where = self.storage.where(rel)
        meta = consolidated.get(rel) if consolidated else None
        if meta is None:
            try:
                meta = jsonio.parse(self.storage.get(array_meta_key(rel, cfg.zarr_format)))
            except KeyNotFound:
                raise CorruptStoreError(f"shard {self.where} has no array {rel}") from None
            except ValueError as e:
                raise CorruptStoreError(f"array metadata of {where} is damaged ({e})") from None
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if not isinstance(shape, list) or len(shape) != 4 or shape[1:] != [cfg.n_layers, seg.t_max, cfg.d_model]:
            raise CorruptStoreError(
                f"array {where} has shape {shape}, expected (n, {cfg.n_layers}, {seg.t_max}, {cfg.d_model})"
            )
        if not isinstance(shape[0], int) or shape[0] < self.entry.n_examples:
            raise CorruptStoreError(
                f"array {where} holds {shape[0]} examples; the manifest says {self.entry.n_examples}"
            )
        self._check_meta(rel, meta)
        try:
            geo = geometry_from_metadata(rel, meta, cfg.n_layers, cfg.d_model)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise CorruptStoreError(f"array metadata of {where} is damaged ({e!r})") from None
        if geo is None:
            fmt, sep = key_scheme(meta)
            self._zkeys[seg.name] = (fmt, sep, declared(meta).shards)
            return None
        return ChunkIO(self.storage, geo)

    def _check_meta(self, rel: str, meta: Any) -> None:
        """Every metadata field that decides how the array's bytes are read, as the format says."""
        problems = array_problems(
            meta, self._specs[rel], self.cfg.zarr_format, self.entry.n_examples, complete=self.entry.complete
        )
        if problems:
            raise CorruptStoreError(
                f"array {self.storage.where(rel)} has {problems[0]}; its metadata was altered (run `actstore verify`)"
            )

    def _open_zarr(self, rel: str) -> Any:
        import zarr

        try:
            return zarr.open_array(
                store=self.storage.zarr_store(rel, read_only=True), mode="r", zarr_format=self.cfg.zarr_format
            )
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise CorruptStoreError(f"array {self.storage.where(rel)} cannot be opened ({e!r})") from None

    def per_sample(self, name: str) -> np.ndarray:
        """A per-sample array (field, `sample_key`, `<segment>_len`, token labels), n rows."""
        arr = self._per_sample.get(name)
        if arr is None:
            rel = keys.field_array(name)
            try:
                meta = catalog.array_meta(self.storage, rel, self.cfg.zarr_format)
                self._check_meta(rel, meta)
            except KeyNotFound:
                raise CorruptStoreError(f"shard {self.where} has no array {rel}") from None
            z = self._open_zarr(rel)
            n = self.entry.n_examples
            if z.shape[0] < n:
                raise CorruptStoreError(
                    f"array {self.storage.where(rel)} holds {z.shape[0]} values; the manifest says {n}"
                )
            if not self._rows_checked:
                rows = catalog.rows_on_disk(self.storage, self.cfg.zarr_format)
                if rows < n:
                    raise CorruptStoreError(
                        f"shard {self.where}: its {spec.SAMPLE_KEY} array has chunk files for at most {rows} examples but the "
                        f"manifest says {n}; the store's counts are damaged (run `actstore verify`)"
                    )
                self._rows_checked = True
            self._check_rows_backed(rel, meta, n, every_chunk(catalog.array_attrs(self.storage, rel, meta)))
            try:
                arr = np.asarray(z[:n])  # n is now bounded by files on disk
            except ActstoreError:
                raise
            except Exception as e:  # noqa: BLE001 - zarr decoding untrusted bytes raises many types
                raise CorruptChunkError(
                    f"array {self.storage.where(rel)} cannot be read ({e!r}); run `actstore verify`"
                ) from None
            self._per_sample[name] = arr
        return arr

    def _check_rows_backed(self, rel: str, meta: dict[str, Any], n: int, dense: bool) -> None:
        """Before a per-sample array is read, every chunk file of its n rows must be on disk at
        its size when the array promises them all (`dense`: spec.EVERY_CHUNK_ATTR), else zarr
        would read a deleted chunk as zeros; and before more than UNCHECKED_READ_BYTES are read
        of any (long rows: token labels or ids of a long segment), so that metadata claiming
        absurd row lengths cannot make zarr allocate them."""
        want = self._specs[rel]
        row = int(np.prod(want.shape[1:], dtype=np.int64)) * np.dtype(want.dtype).itemsize
        big = n * row > UNCHECKED_READ_BYTES
        if not (dense or big):
            return
        fmt, sep = key_scheme(meta)
        rows = chunk_rows(meta, want)
        for c in range(-(-n // rows)):
            key = row_chunk_key(rel, fmt, sep, len(want.shape), c)
            size = self.storage.size(key)
            if size == rows * row:
                continue
            if size is None and not big and self.storage.kind(key) is not None:
                continue  # a folder, link or FIFO where the chunk belongs: the read names it
            if dense and size is None:
                raise CorruptChunkError(
                    f"chunk file {self.storage.where(key)} of per-sample array {keys.basename(rel)} is missing: it holds the "
                    f"values of examples {c * rows}..{min(n, (c + 1) * rows) - 1} of the shard, which its writer "
                    "wrote in full (zeros included), so they are lost, not zeros. Restore the file from a copy of the store "
                    "or write the shard again (run `actstore verify` for every damaged file)"
                )
            if big:  # else a chunk of the wrong size is left to the read, which refuses it
                raise CorruptStoreError(
                    f"array {self.storage.where(rel)} claims rows of {row} bytes ({n} rows: {n * row} bytes), but its chunk file "
                    f"{self.storage.where(key)} does not hold {rows * row} bytes: the metadata claim more than the data on "
                    f"disk (reads above {UNCHECKED_READ_BYTES} bytes are checked first); run `actstore verify`"
                )

    def lengths(self, seg: SegmentSpec) -> np.ndarray:
        arr = self._lengths.get(seg.name)
        if arr is None:
            arr = self.per_sample(keys.len_field(seg.name))
            if arr.size and (arr.min() < 0 or arr.max() > seg.t_max):
                raise CorruptStoreError(
                    f"shard {self.where}: lengths of segment {seg.name!r} lie outside 0..{seg.t_max}"
                )
            self._lengths[seg.name] = arr
        return arr

    def read_padded(self, seg: SegmentSpec, local: int, lp: int, out: np.ndarray) -> None:
        """Fill `out` ((k * t_chunk, D), the stored dtype) with the first k token chunks (all
        of them when out has seg.t_pad rows or more, the rest of `out` untouched)."""
        io = self.io[seg.name]
        if io is not None:
            if io.read_into(local, lp, out) or self.check_reads:
                self._check_crc(seg, local, lp, out)
            return
        self._read_zarr(seg, local, lp, out)
        if self.check_reads or self._zarr_absent(seg, local, lp):
            self._check_crc(seg, local, lp, out)

    def read_mapped(self, seg: SegmentSpec, local: int, lp: int, out: np.ndarray) -> bool:
        """read_padded as one copy from a mapped local shard file when every byte is in the
        page cache (ChunkIO.read_mapped); False (nothing read) otherwise: then read_padded."""
        io = self.io[seg.name]
        return io is not None and not self.check_reads and io.read_mapped(local, lp, out)

    def _read_zarr(self, seg: SegmentSpec, local: int, lp: int, out: np.ndarray) -> None:
        z = self._zarr.get(seg.name)
        if z is None:
            z = self._zarr[seg.name] = self._open_zarr(keys.acts_array(seg.name))
        k = min(out.shape[0], seg.t_pad)
        t = min(k, seg.t_max)
        try:
            out[:t] = z[local, lp, :t]
        except ActstoreError:
            raise
        except Exception as e:  # noqa: BLE001 - zarr decoding untrusted bytes raises many types
            raise CorruptChunkError(
                f"array {self.storage.where(keys.acts_array(seg.name))} cannot be read at example {local} of the shard, "
                f"layer position {lp} ({e!r}); run `actstore verify --deep`"
            ) from None
        out[t:k] = 0

    def _zarr_absent(self, seg: SegmentSpec, local: int, lp: int) -> bool:
        """Whether a chunk object of (local, lp) is absent (zarr read it as the fill value)."""
        fmt, sep, shards = self._zkeys[seg.name]
        head = f"{keys.acts_array(seg.name)}/" + (f"c{sep}" if fmt == 3 else "")
        if shards is not None:
            return self.storage.size(f"{head}{local // shards[0]}{sep}0{sep}0{sep}0") is None
        return any(self.storage.size(f"{head}{local}{sep}{lp}{sep}{tc}{sep}0") is None for tc in range(seg.n_chunks))

    def _check_crc(self, seg: SegmentSpec, local: int, lp: int, out: np.ndarray) -> None:
        """Check a read against the writer's crc32c of the whole padded (example, layer):
        after a read that met absent chunks (they read as zeros: right where the writer
        omitted chunks of zeros, as zarr does, damage where a chunk file was deleted), and
        after every read when `check_reads`. A shard without per-example checksums cannot tell."""
        want = self._el_crc(seg, local, lp)
        if want is None:
            return
        rows = seg.t_pad
        full = out
        if out.shape[0] < rows:  # the read stopped at the example's tokens: the checksum covers every chunk
            full = np.empty((rows, self.cfg.d_model), dtype=out.dtype)
            io = self.io[seg.name]
            io.read_into(local, lp, full) if io is not None else self._read_zarr(seg, local, lp, full)
        got = crc32c(np.ascontiguousarray(full[:rows]))
        if got == want:
            return
        where = f"(example {local} of shard {self.where}, layer {self.cfg.layers[lp]}, segment {seg.name!r})"
        if self.check_reads:
            raise CorruptChunkError(
                f"the chunk bytes of {where} read back differ from what its writer wrote: it recorded crc32c "
                f"{want:#010x}, the read gives {got:#010x}; run `actstore verify --deep` for every damaged chunk"
            )
        raise CorruptChunkError(
            f"a chunk of {where} is missing and reads as zeros, but the writer recorded crc32c {want:#010x} for it, "
            f"not {got:#010x}: a chunk file was deleted; run `actstore verify`"
        )

    def _el_crc(self, seg: SegmentSpec, local: int, lp: int) -> int | None:
        """The writer's crc32c of one (example, segment, layer), or None (no checksums file):
        one ranged read, or (checking every read) the shard's whole file, read once."""
        si = [s.name for s in self.cfg.segments].index(seg.name)
        if self._el_crcs is not None:
            return int(self._el_crcs[local, si, lp])
        size = self.storage.size(keys.EL_CRC)
        if size is None:
            return None
        need = records.el_crc_nbytes(self.entry.n_examples, self.cfg)
        if size < need:
            raise CorruptStoreError(
                f"{self.storage.where(keys.EL_CRC)} has {size} bytes; {self.entry.n_examples} examples need {need}"
            )
        if self.check_reads:
            self._el_crcs = records.parse_el_crcs(
                self.storage.get_range(keys.EL_CRC, 0, need), self.entry.n_examples, self.cfg
            )
            return int(self._el_crcs[local, si, lp])
        return int.from_bytes(
            self.storage.get_range(keys.EL_CRC, records.el_crc_offset(local, si, lp, self.cfg), 4), "little"
        )

    def check_backed(self, seg: SegmentSpec) -> None:
        """Before a read of more than UNCHECKED_READ_BYTES of one (example, layer) of `seg`:
        the chunk data the metadata claim must be on disk (raw layouts: the last token chunk
        of the shard's first example at its size), so metadata lying about token counts
        cannot make a reader allocate what no file holds. Once per segment."""
        io = self.io[seg.name]
        if io is None or seg.name in self._backed or not self.entry.n_examples:
            return
        g = io.geo
        tc = g.n_tchunks - 1
        if g.shard_examples is None:
            key = g.chunk_key(0, 0, tc)
            ok = self.storage.size(key) == g.chunk_nbytes
        else:
            key = g.shard_key(0)
            index = io.shard_index(key)
            ok = index is not None and index[0, 0, tc, 0] != EMPTY and int(index[0, 0, tc, 1]) == g.chunk_nbytes
        if not ok:
            raise CorruptStoreError(
                f"segment {seg.name!r} claims {seg.t_max} tokens ({g.n_tchunks} chunks of {g.chunk_nbytes} bytes per example and "
                f"layer), but {self.storage.where(key)} does not hold its last token chunk: the metadata claim more than the data "
                f"on disk (reads above {UNCHECKED_READ_BYTES} bytes are checked first); run `actstore verify`"
            )
        self._backed.add(seg.name)

    def read_cached(self, seg: SegmentSpec, local: int, lp: int, out: np.ndarray) -> bool:
        io = self.io[seg.name]
        return io is not None and not self.check_reads and io.read_cached(local, lp, out)

    def read_many(self, seg: SegmentSpec, items: list[tuple[int, int, np.ndarray]]) -> None:
        """read_padded of many (local, lp, out): the chunks of one object read together."""
        io = self.io[seg.name]
        if io is None:
            for local, lp, out in items:
                self.read_padded(seg, local, lp, out)
        else:
            absent = read_many(io, items)  # a chunk read as zeros: omitted, or deleted?
            for local, lp, out in items if self.check_reads else absent:
                self._check_crc(seg, local, lp, out)

    def files(self, seg: SegmentSpec) -> tuple[int, int] | None:
        """(number of files, largest file's bytes) of a segment's raw chunks on a local disk,
        or None when they cannot be mapped (another storage, or zarr-python's codecs)."""
        io = self.io[seg.name]
        if io is None or not isinstance(self.storage, LocalStorage):
            return None
        g, n = io.geo, self.entry.n_examples
        if g.shard_examples is None:
            return n * g.n_layers * g.n_tchunks, g.chunk_nbytes
        per_file = g.shard_examples * g.n_layers * g.n_tchunks * g.chunk_nbytes + g.index_nbytes
        return -(-n // g.shard_examples), per_file

    def map_chunks(self, seg: SegmentSpec, region: FileRegion, local: int, lp: int) -> list[MappedChunk] | None:
        io = self.io[seg.name]
        if io is None or self.check_reads:
            return None  # read instead (e.g. an absent chunk, or reads that are checked)
        return map_chunks(io, region, local, lp)

    # ---- texts ----------------------------------------------------------------------
    def text(self, name: str, local: int) -> Any:
        """The value of text field `name` of local example `local`."""
        data, offsets = self._text(name)
        return text_value(
            data[offsets[local] : offsets[local + 1]], self.storage.where(keys.text_file(name)), local, name
        )

    def texts(self, name: str):
        data, offsets = self._text(name)
        where = self.storage.where(keys.text_file(name))
        for i in range(self.entry.n_examples):
            yield text_value(data[offsets[i] : offsets[i + 1]], where, i, name)

    def _text(self, name: str) -> tuple[bytes, np.ndarray]:
        """The committed lines of a text file and their offsets (n + 1), read once."""
        cached = self._text_offsets.get(name)
        key = keys.text_file(name)
        if cached is None:
            data = self.storage.get(key)
            ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 0x0A)[: self.entry.n_examples] + 1
            if len(ends) < self.entry.n_examples:
                raise CorruptStoreError(f"{self.storage.where(key)} has fewer than {self.entry.n_examples} lines")
            offsets = np.concatenate([[0], ends])
            want = self.commit.text_bytes.get(name)
            end = int(offsets[-1])
            if want is not None and (end > want or (self.commit.n_committed == self.entry.n_examples and end != want)):
                raise CorruptStoreError(
                    f"{self.storage.where(key)}: its first {self.entry.n_examples} lines take {end} bytes; the commit record says "
                    f"{want} for its {self.commit.n_committed} committed lines: the file was altered (run `actstore verify --deep`)"
                )
            cached = self._text_offsets[name] = (data, offsets)
        return cached


def text_value(line: bytes, where: str, i: int, name: str) -> Any:
    """The value of text `name` on line i of its .jsonl file (which names example i),
    refusing damaged lines."""
    try:
        index, value = texts.parse_line(line, where, name)
    except CorruptStoreError as e:
        raise CorruptStoreError(f"{where}: line {i + 1} is damaged ({e}); run `actstore verify --deep`") from None
    if type(index) is not int or index != i:
        raise CorruptStoreError(
            f"{where}: line {i + 1} holds the text of example {index!r}, not {i}; run `actstore verify --deep`"
        )
    return value
