"""Finding and loading weights: local checkpoints, Hugging Face repos, GGUF files (gguf/) and the
offline default model. Imports models, never the engine."""
