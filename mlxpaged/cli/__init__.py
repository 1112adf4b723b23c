"""The `mlxpaged` command: `generate` (main.py), `doctor`, and `pull`, `ls`, `rm` (models.py: the
models on disk); the flags `generate` and `serve` share live in `engine/flags.py`. `serve` and
`bench` live in server/ and bench/ and load on demand.
May import: `engine`, `core`, `worker`, `attention`, `server`, `bench`, `loading`."""
