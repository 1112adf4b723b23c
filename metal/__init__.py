"""Metal sources of the paged-attention kernel (`paged_attention.h` and `paged_attention.metal`), shipped as package
data."""
