"""The request's front door: `LLMEngine` (intake, the step pipeline, outputs), `LLM`, sampling,
beam search, the engine's flags and the one engine builder; nothing here is imported by core or
worker. May import: `core`, `worker`, `attention`, `models`, `loading`, and `distributed` (from
`engine.builder` only)."""
