"""Who runs and where its tokens live: the scheduler, the block manager and the block pool, plus
the request and sequence state they own. Pure Python and numpy: no MLX, no model, no engine type
(what core reads of the engine's objects it states as protocols, `sequence.RequestParams`).
May import: no other package (the shared modules only)."""
