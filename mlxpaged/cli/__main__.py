"""`python -m mlxpaged.cli ...`: the `mlxpaged` command (what `mlx.launch -- -m mlxpaged.cli` runs)."""

from .main import main

main()
