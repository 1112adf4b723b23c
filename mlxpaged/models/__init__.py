"""mlx-lm's model modules on the paged KV cache (paged_adapter.py); a hybrid model's recurrent
layers on each sequence's own state in the packed pass (recurrent.py); RoPE tables (rotary.py).
May import: `attention`."""
