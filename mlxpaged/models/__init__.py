"""Model architectures written against the paged KV cache."""
