"""The on-disk format of an actstore store, known here and nowhere else.

- `spec`: constants (format version, dtypes, limits) mirroring docs/format.md;
- `keys`: the name of every file and array, as storage keys;
- `records`: the JSON records (identity, commit, blocks, manifest, shard attributes);
- `config`: the store configuration (its identity);
- `chunks`: chunk geometry (which key holds which bytes) for raw-chunk I/O;
- `texts`: the lines of a shard's text files;
- `jsonio`: bounded JSON parsing, standard JSON writing.

Nothing here does I/O: it turns bytes into typed records and back.
"""
