"""Who runs and where its tokens live: the scheduler, the block manager and the block pool, plus
the request and sequence state they own. Pure Python and numpy: no MLX, no model; imports
nothing of mlxpaged but `config`, `errors` and `utils`."""
