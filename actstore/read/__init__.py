"""Reading a store: one shard's files (read.shard), selections of many examples and layers
by slices and lists (read.select), and a lazy xarray view of a whole store (read.xarray).

read.select and read.xarray work on a store through its public reading API only (`len`,
`layers`, `d_model`, `dtype`, `config.segments`, `lengths(ex)`, `read_into(ex, layer,
segment, out)`), so an actstore store and a saev directory opened by `actstore.open` read
the same way.
"""
