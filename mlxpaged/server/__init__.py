"""`mlxpaged serve`: an OpenAI-compatible HTTP server on `LLMEngine` (needs the `serve` extra).

Layout: `protocol` (typed request bodies), `errors` (the one OpenAI error object), `prompts`
(messages and prompts to token ids), `engine_loop` (the one thread that drives the engine),
`responses` (outputs to JSON and stream chunks), `metrics` (Prometheus), `app` (FastAPI
routes), `cli` (the click command).
"""
