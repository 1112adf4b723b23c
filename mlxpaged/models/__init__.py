"""mlx-lm's model modules on the paged KV cache (paged_adapter.py); RoPE tables (rotary.py).
May import: `attention`."""
