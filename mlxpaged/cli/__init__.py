"""The `mlxpaged` command: `generate` (main.py), the flags `generate` and `serve` share
(options.py) and `doctor`. `serve` and `bench` live in server/ and bench/ and load on demand."""
