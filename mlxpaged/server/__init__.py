"""`mlxpaged serve`: an OpenAI-compatible HTTP server on `LLMEngine` (needs the `serve` extra).

Layout: `protocol` (typed request bodies), `errors` (the one OpenAI error object), `prompts`
(messages and prompts to token ids), `engine_loop` (the one thread that drives the engine),
`responses` (outputs to JSON and stream chunks), `metrics` (Prometheus), `limits` (what one
request may ask), `middleware` (auth, body cap, draining, the catch-all 500, for every route),
`connections` (header deadline, fd limit, accept errors), `app` (FastAPI routes), `web` (the
page at `/` and its cache view, docs/web.md), `cli` (the click command). Behaviour under hostile
clients: docs/server.md.
"""
