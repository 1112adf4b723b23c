"""The request's front door: `LLMEngine` (intake, the step pipeline, outputs), `LLM`, sampling,
beam search and the one engine builder. May import core, worker, attention, models, loading and
(in the builder only) distributed; nothing here is imported by core or worker."""
