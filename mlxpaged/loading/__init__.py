"""Finding and loading weights: local checkpoints, Hugging Face repos, GGUF files (gguf/) and the
offline default model; `loader.load` decides what a checkpoint is (text, vision, or an encoder for
mlx-embeddings: encoder.py); never the engine. May import: `models`."""
