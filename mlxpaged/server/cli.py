"""`mlxpaged serve`: load a model, start the engine thread, serve the OpenAI API with uvicorn.

Only click is imported at module level, so `mlxpaged generate` works without the `serve`
extra; `serve` itself says what to install when FastAPI, uvicorn or prometheus-client is missing.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys

import click

from ..cli.options import engine_config, model_and_engine_options
from ..errors import MlxPagedError


def _fail(msg: str) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(1)


def _check_port(host: str, port: int) -> None:
    """Fail in one line before loading the model, rather than after, in uvicorn's words."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            _fail(f"cannot listen on {host}:{port}: {e.strerror}")


@click.command()
@model_and_engine_options("sized from free memory")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 exposes the server to the network).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", envvar="MLXPAGED_API_KEY", default=None, help="Require 'Authorization: Bearer KEY' on /v1/ routes (env MLXPAGED_API_KEY).")
@click.option("--max-queue", default=1024, show_default=True, type=click.IntRange(1), help="Requests waiting for admission before new ones get 503.")
@click.option("--served-model-name", default=None, help="The model id of /v1/models (default: --model, or the checkpoint's folder name).")
@click.option("--shutdown-timeout", default=5.0, show_default=True, help="Seconds Ctrl-C lets running requests finish before aborting them.")
@click.option("--kv-memory-gb", default=None, type=click.FloatRange(min=0, min_open=True), help="Cap of the KV pool, which grows as blocks are needed and shrinks when idle (default: a quarter of free memory; --num-blocks fixes the pool instead).")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]), show_default=True)
def serve(model, dtype, weights, host, port, api_key, max_queue, served_model_name, shutdown_timeout, kv_memory_gb,
          log_level, **engine_flags):
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        _fail(f"`serve` needs {e.name}: install mlxpaged[serve] (pip install 'mlxpaged[serve]')")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from ..distributed.collectives import launched_group

    group = launched_group()  # under mlx.launch: tensor parallel; rank 0 serves HTTP, the others follow it
    try:
        config = engine_config(engine_flags)
        if kv_memory_gb is not None:
            if config.num_blocks is not None:
                raise ValueError("--kv-memory-gb caps a growing pool; --num-blocks fixes its size: give one")
            config = dataclasses.replace(config, kv_memory_gb=kv_memory_gb)
    except ValueError as e:
        _fail(str(e))
    make = lambda: _load_engine(model, dtype, weights, config, group)  # noqa: E731
    if group is not None and group.rank() != 0:
        return _follow(make, group)
    _check_port(host, port)
    from .app import build_app
    from .engine_loop import EngineLoop
    from .metrics import Metrics

    metrics = Metrics()
    engine_loop = EngineLoop(make, observer=metrics, group=group)
    try:
        engine_loop.start()
    except (MlxPagedError, ValueError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        click.echo("interrupted while loading the model", err=True)
        sys.exit(130)
    engine, loaded = engine_loop.engine, engine_loop.engine.loaded
    model_id = served_model_name or model or loaded.path.name
    metrics.attach(engine_loop)
    app = build_app(engine_loop, metrics, model_id=model_id, model_aliases={loaded.path.name, str(loaded.path)},
                    api_key=api_key, max_queue=max_queue)
    _announce(host, port, model_id, loaded, engine, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=shutdown_timeout + 5, lifespan="on")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Streams end themselves (finished, or aborted with an error event) before uvicorn's own deadline.
            engine_loop.drain(shutdown_timeout)
            super().handle_exit(sig, frame)

    try:
        Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT once it has shut down cleanly
        pass
    click.echo("mlxpaged serve: stopped", err=True)
    if group is not None:
        _exit_now()


def _load_engine(model, dtype, weights, config, group=None):
    """The engine `serve` runs: the whole model here, or this rank's shard under mlx.launch."""
    from ..engine.builder import build_engine

    return build_engine(model, config, dtype=dtype, weights=weights, group=group)


def _follow(make_engine, group) -> None:
    """A rank other than 0 of a tensor-parallel server: no HTTP; replay rank 0's steps until it stops."""
    from .engine_loop import follow

    try:
        engine = make_engine()
    except (MlxPagedError, ValueError) as e:
        _fail(str(e))
    click.echo(f"mlxpaged serve: rank {group.rank()} of {group.size()} following rank 0", err=True)
    follow(engine, group)
    click.echo(f"mlxpaged serve: rank {group.rank()} stopped", err=True)
    _exit_now()


def _exit_now() -> None:
    """Exit 0 without interpreter teardown: MLX's ring backend, used from the engine thread, can
    abort the process ("terminate called without an active exception") while Python finalizes."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _announce(host, port, model_id, loaded, engine, api_key) -> None:
    from ..attention import resolve_impl

    bs = engine.config.block_size
    cfg = engine.config
    kv = f" ({cfg.kv_bits}-bit K/V, group {cfg.kv_group_size})" if cfg.kv_bits else ""
    cap = engine.max_blocks
    grows = (f", grows to {cap} blocks ({cap * engine.kv_cache.shape.bytes_per_block(bs) / 1e9:.3f} GB) as needed"
             if cap > engine.num_blocks else "")
    click.echo(
        f"mlxpaged serve: http://{host}:{port}/v1  model {model_id} ({loaded.path}, {loaded.dtype})\n"
        f"  KV pool: {engine.num_blocks} blocks x {bs} tokens = {engine.num_blocks * bs} tokens, "
        f"{engine.kv_cache.nbytes / 1e9:.3f} GB{kv}{grows}; attention: {resolve_impl(engine.config.attention_impl)}; "
        f"prefix caching: {'on' if engine.config.enable_prefix_caching else 'off'}; "
        f"auth: {'API key' if api_key else 'none'}",
        err=True,
    )
