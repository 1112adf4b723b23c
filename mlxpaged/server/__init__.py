"""`mlxpaged serve`: an OpenAI- and Anthropic-compatible HTTP server on `LLMEngine` (needs the `serve` extra).

Layout: `bodies` (the strict body base; surrogate and nesting checks), `protocol` (OpenAI's typed
bodies), `anthropic_api`, `responses_api` and `openai_api` (each family's routes and its wire
format), `admission` (the one way in for every route: limits, the character count, tokenizing off
the event loop, the default max_tokens, the job), `jobs` (the engine requests behind one HTTP
request, streams that abort them however they end), `turns` (one assistant turn as events, for
Messages and Responses), `tools` (tool-call formats: rendering, parsing, streaming, the forcing
grammar), `guided_request` (which tools, which grammar), `prompts` (messages and prompts to token
ids; client text is text), `openai_format` (outputs to OpenAI JSON, stream hold-back), `errors`
(the one OpenAI error object), `engine_loop` (the one thread that drives the engine; requests'
wire form for tensor parallelism), `metrics` (Prometheus), `limits` (what one request may ask),
`middleware` (auth, body cap, draining, the catch-all 500, the access line, for every route),
`keepalive` (beats on a silent stream), `connections` (header deadline, fd limit, accept
errors), `tokenize_api` (vLLM's /tokenize and /detokenize), `app` (wiring), `web` (the page at
`/` and its cache view, docs/web.md), `cli` (the click command), `models_api` (the served models'
cards and /v1/models), `ollama_api` (Ollama's /api/... routes).
Behaviour under hostile clients: docs/server.md.
May import: `engine`, `core`, `attention`, `loading` (what a checkpoint's files say: `loading.catalog`,
`loading.encoder`).
"""
