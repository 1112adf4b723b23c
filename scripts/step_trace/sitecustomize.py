"""A per-step trace of a server's engine, for profiling a benchmark run (docs/serving-benchmark.md,
"Coding-agent conversations"). Not part of the package: Python imports
this file at start-up when its folder is on PYTHONPATH, and it does anything only when
MLXPAGED_STEP_TRACE names a file prefix:

    PYTHONPATH=scripts/step_trace MLXPAGED_STEP_TRACE=/tmp/trace python scripts/bench_agents.py ...

Each mlxpaged process then appends one line per non-empty step to PREFIX.<pid>: the step's start
(perf_counter s), its wall time (s), its prefill tokens, its decodes, the requests still waiting,
and each prefill chunk as `request-id-tail:tokens:computed-after`. Other processes (mlx_lm.server)
are left alone.
"""

import os
import sys

_PREFIX = os.environ.get("MLXPAGED_STEP_TRACE")

if _PREFIX and "mlx_lm.server" not in " ".join(sys.argv):
    import time

    import mlxpaged.engine.llm_engine as _le

    _out = open(f"{_PREFIX}.{os.getpid()}", "a", buffering=1)
    _step, _schedule = _le.LLMEngine.step, _le.LLMEngine._schedule

    def _traced_schedule(self):
        self._trace_out = _schedule(self)
        return self._trace_out

    def _traced_step(self):
        t = time.perf_counter()
        try:
            return _step(self)
        finally:
            out = getattr(self, "_trace_out", None)
            if out is not None and not out.empty:
                chunks = ",".join(
                    f"{c.request.request_id[-4:]}:{c.num_tokens}:{c.seq.num_computed_tokens}" for c in out.prefills
                )
                prefill = sum(c.num_tokens for c in out.prefills)
                _out.write(
                    f"{t:.3f} {time.perf_counter() - t:.3f} {prefill} {len(out.decodes)} "
                    f"{len(self.scheduler.waiting)} {chunks}\n"
                )

    _le.LLMEngine._schedule = _traced_schedule
    _le.LLMEngine.step = _traced_step
