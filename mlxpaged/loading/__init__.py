"""Finding and loading weights: local checkpoints, Hugging Face repos, GGUF files (gguf/) and the
offline default model; never the engine. May import: `models`."""
