"""The streaming top-k pass over a layer: its reading in groups, the host and device consumers that encode
and accumulate, the compiled kernels, its tables for both tails, and their files published whole."""
