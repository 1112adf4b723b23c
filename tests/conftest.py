"""Shared fixtures, the test tiers and the skip policy.

Tiers (markers, one per file, set here so that no file is left without one):
  unit       pure logic and numerics against numpy / SDPA references, no model
  engine     the engine on tiny random-weight checkpoints against mlx-lm's contiguous cache
  emulator   Metal kernels in the MSL emulator, and the MSL front-end check
  server     `mlxpaged serve` subprocesses driven by HTTP clients
  tp         two tensor-parallel ranks under `mlx.launch`
  soak       long server runs (memory after many requests)
  real_model added to any test that uses the offline Qwen2.5 weights (the fixtures below)
The quick loop: `python -m pytest -m "not emulator and not real_model"`.

Skips: a test may skip only with a reason that starts with "[expected]" (an opt-in sweep, a
second compiler that the first CI pass lacks, data a checkout may lack). Under CI=true any other
skip fails the run, so a broken dependency can never pass as "skipped".
"""

import os
from pathlib import Path

import pytest

import mlxpaged  # noqa: F401  (first: it points MLX at the system OpenBLAS before MLX loads)
from mlxpaged.testing.slowness import timeout_scale
from mlxpaged.testing.tiny_model import write_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_path):
    from mlxpaged.loading.loader import load

    return load(str(tiny_model_path), "float32")


@pytest.fixture
def emulated(monkeypatch, request):
    """Run the Metal kernels in the MSL emulator; yields a setter for the emulator's lane order.

    A module that sets `RESET_KERNELS = True` (its tests patch kernel sources or factories) gets
    fresh kernel caches after each test; the others share compiled kernels across tests.
    """
    import mlxpaged.metal_emu as emu

    monkeypatch.setenv("MLXPAGED_METAL", "emulate")

    def set_order(order: str):
        monkeypatch.setenv("MLXPAGED_EMU_ORDER", order)

    with emu.emulate():
        yield set_order
    if getattr(request.module, "RESET_KERNELS", False):
        from mlxpaged.attention import metal, metal_varlen

        metal.reset_kernels()
        metal_varlen._kernel.cache_clear()


@pytest.fixture(scope="session")
def mlx_lm_tiny(tiny_model_path):
    """The same checkpoint loaded by mlx-lm's own Qwen2 implementation (the contiguous reference)."""
    import mlx_lm

    return mlx_lm.load(str(tiny_model_path))


@pytest.fixture(scope="session")
def real_ref():
    """mlx-lm's own model of the offline Qwen2.5-0.5B (its float16 checkpoint, in float32) and its
    tokenizer: the contiguous reference of the real-model tier, loaded once for all its files.
    Shared, so a test that swaps its weights must put them back (in a `finally`)."""
    import mlx.core as mx
    import mlx_lm

    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.offline_model import ensure_offline_model

    model, tokenizer = mlx_lm.load(str(convert_gguf(ensure_offline_model())))
    model.set_dtype(mx.float32)
    return model, tokenizer


@pytest.fixture(scope="session")
def real(real_ref):
    """(mlxpaged's load of the same checkpoint in float32, the mlx-lm reference model)."""
    from mlxpaged.loading.gguf import convert_gguf
    from mlxpaged.loading.loader import load
    from mlxpaged.loading.offline_model import ensure_offline_model

    return load(str(convert_gguf(ensure_offline_model())), "float32"), real_ref[0]


FILE_TIERS = {
    "test_block_manager.py": "unit",
    "test_config.py": "unit",
    "test_sampler.py": "unit",
    "test_waste.py": "unit",
    "test_paged_attention.py": "unit",
    "test_attention_runs.py": "unit",
    "test_rotary.py": "unit",
    "test_gguf.py": "unit",
    "test_imports.py": "unit",
    "test_lint.py": "unit",
    "test_scheduler.py": "engine",
    "test_engine.py": "engine",
    "test_lora.py": "engine",
    "test_deltas.py": "engine",
    "test_detokenizer.py": "engine",
    "test_prompt_logprobs.py": "engine",
    "test_engine_lifecycle.py": "engine",
    "test_async_step.py": "engine",
    "test_beam_search.py": "engine",
    "test_varlen.py": "engine",
    "test_kv_quant.py": "engine",
    "test_cli.py": "engine",
    "test_loader.py": "engine",
    "test_gguf_quantized.py": "engine",
    "test_bench_sharing.py": "engine",
    "test_bench.py": "engine",
    "test_prefix_disk.py": "engine",
    "test_disk_trust.py": "engine",
    "test_kv_pool_growth.py": "engine",
    "test_bench_http.py": "server",
    "test_bench_agents.py": "server",
    "test_families.py": "engine",
    "test_zoo.py": "engine",
    "test_vision.py": "engine",
    "test_vision_features.py": "engine",
    "test_vision_server.py": "server",
    "test_vision_routes.py": "server",
    "test_vision_families_server.py": "server",
    "test_vision_tiles.py": "engine",  # its server test marked server too
    "test_hybrid.py": "engine",
    "test_windows.py": "engine",
    "test_per_layer_kv.py": "engine",
    "test_window_groups.py": "engine",
    "test_kv_groups.py": "engine",
    "test_gguf_llama.py": "engine",
    "test_guided.py": "engine",
    "test_cli_knobs.py": "engine",
    "test_sampling_knobs.py": "engine",
    "test_notebooks.py": "engine",
    "test_real_model.py": "real_model",
    "test_metal_emu.py": "emulator",
    "test_metal_kernel.py": "emulator",
    "test_metal_kernel_v2.py": "emulator",
    "test_metal_kv_quant.py": "emulator",
    "test_metal_merge.py": "emulator",
    "test_metal_varlen.py": "emulator",
    "test_metal_varlen_window.py": "emulator",
    "test_metal_window.py": "emulator",
    "test_model_metal.py": "emulator",
    "test_emu_blind_spots.py": "emulator",
    "test_emu_compilers.py": "emulator",
    "test_emu_simdgroup_matrix.py": "emulator",
    "test_doctor.py": "emulator",
    "test_emu_msl_rules.py": "emulator",
    "test_metal_frontend.py": "emulator",
    "test_metal_launch_limits.py": "emulator",
    "test_server.py": "server",
    "test_server_lora.py": "server",
    "test_server_security.py": "server",
    "test_server_abuse.py": "server",
    "test_server_knobs.py": "server",
    "test_server_tools.py": "server",
    "test_server_anthropic.py": "server",
    "test_server_responses.py": "server",
    "test_server_one_path.py": "server",
    "test_server_spine.py": "server",
    "test_server_deltas.py": "server",
    "test_server_agents.py": "server",
    "test_server_lmeval.py": "server",
    "test_server_clients.py": "server",
    "test_server_ollama.py": "server",
    "test_embeddings.py": "server",
    "test_encoders.py": "server",
    "test_server_models.py": "server",
    "test_cli_models.py": "engine",
    "test_server_limits.py": "server",
    "test_server_tp.py": "tp",
    "test_hostile_guided.py": "server",
    "test_hostile_disk.py": "engine",
    "test_web.py": "server",
    "test_tp.py": "tp",
    "test_spec_decode.py": "engine",
    "test_spec_draft.py": "engine",
    "test_spec_real_model.py": "real_model",
    "test_spec_tp.py": "tp",
    "test_server_soak.py": "soak",
    "test_startup_exits.py": "server",
    "test_slowness.py": "unit",
    "test_logprob_bytes.py": "server",
}
# Fixtures that load the offline Qwen2.5 weights: a test using one is in the real_model tier too.
REAL_MODEL_FIXTURES = {"real", "real_ref", "real_gguf", "real_ckpt", "real_pair", "real_dequantized"}
EXPECTED_SKIP = "[expected]"
_timeouts = {"scale": 1.0}  # the factor this run's collection put on every test's timeout


def pytest_collection_modifyitems(config, items):
    missing = sorted({item.path.name for item in items if item.path.name not in FILE_TIERS})
    if missing:
        raise pytest.UsageError(f"tests/conftest.py FILE_TIERS has no tier for {', '.join(missing)}")
    # Timeouts catch livelocks, not slow machines: each test's limit (pyproject's `timeout`, or its
    # own mark) holds on a quiet machine and is stretched here for a busy one.
    scale = _timeouts["scale"] = timeout_scale()
    default = config.getoption("timeout", None) or float(config.getini("timeout") or 0)
    for item in items:
        item.add_marker(FILE_TIERS[item.path.name])
        mark = item.get_closest_marker("timeout")
        args, kwargs = (mark.args, dict(mark.kwargs)) if mark is not None else ((), {})
        base = float(args[0] if args else kwargs.pop("timeout", default) or 0)
        if base > 0:
            item.add_marker(pytest.mark.timeout(base * scale, *args[1:], **kwargs), append=False)  # first: it wins
        if REAL_MODEL_FIXTURES & set(item.fixturenames) or item.path.name == "test_real_model.py":
            item.add_marker("real_model")


_unexpected_skips: list[str] = []
_tier_seconds: dict[str, float] = {}
_tier_of: dict[str, str] = {}  # nodeid -> its tier, for the timing summary
TIERS = ("unit", "engine", "emulator", "server", "tp", "soak", "real_model")


def pytest_collection_finish(session):
    for item in session.items:
        marks = {m.name for m in item.iter_markers()}
        # A test counts in its most specific tier: real_model, tp, soak, emulator, server, then the file's.
        _tier_of[item.nodeid] = next(
            (t for t in ("real_model", "tp", "soak", "emulator", "server") if t in marks),
            FILE_TIERS.get(item.path.name, "?"),
        )


def pytest_runtest_logreport(report):
    tier = _tier_of.get(report.nodeid)
    if tier is not None:
        _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + report.duration
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if EXPECTED_SKIP not in reason:
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and os.environ.get("CI") and os.environ.get("MLXPAGED_ALLOW_SKIPS") != "1":
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(f"test timeouts: {_timeouts['scale']:.0f} x their quiet-machine limits (conftest.py)")
    if _tier_seconds:
        counts = {t: sum(1 for v in _tier_of.values() if v == t) for t in _tier_seconds}
        terminalreporter.write_line(
            "time per tier (setup + call + teardown): "
            + ", ".join(f"{t} {_tier_seconds[t]:.0f} s ({counts[t]} tests)" for t in TIERS if t in _tier_seconds)
        )
    if _unexpected_skips:
        verdict = (
            "fail the run under CI=true"
            if os.environ.get("CI") and os.environ.get("MLXPAGED_ALLOW_SKIPS") != "1"
            else "allowed outside CI"
        )
        terminalreporter.write_line(
            f"{len(_unexpected_skips)} unexpected skip(s) ({verdict}; MLXPAGED_ALLOW_SKIPS=1 opts out):"
        )
        for line in _unexpected_skips:
            terminalreporter.write_line(f"  {line}")
