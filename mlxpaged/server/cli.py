"""`mlxpaged serve`: load a model, start the engine thread, serve the OpenAI API with uvicorn.

Only click is imported at module level, so `mlxpaged generate` works without the `serve`
extra; `serve` itself says what to install when FastAPI, uvicorn or prometheus-client is missing.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import click

from ..config import EngineConfig
from ..engine.flags import (
    SERVE_CPU_CHUNK,
    engine_config,
    fail,
    launched_rank,
    model_and_engine_options,
    user_errors,
)
from .limits import MAX_STOPS_CAP, Limits


def _check_port(host: str, port: int) -> None:
    """Fail in one line before loading the model, rather than after, in uvicorn's words."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            fail(f"cannot listen on {host}:{port}: {e.strerror}")


def serve_engine_config(engine_flags: dict, kv_memory_gb: float | None) -> EngineConfig:
    """The served engine's settings from `serve`'s flags: the prefill chunk resolved for the
    device (SERVE_CPU_CHUNK on the CPU, where `bench_agents.py` and a chunk-size scan measured
    smaller chunks prefilling as fast), and the growing pool's cap."""
    if engine_flags["max_num_batched_tokens"] is None:
        import mlx.core as mx

        engine_flags["max_num_batched_tokens"] = SERVE_CPU_CHUNK if mx.default_device() == mx.cpu else 2048
    config = engine_config(engine_flags)
    if kv_memory_gb is not None:
        if config.cache.num_blocks is not None:
            raise ValueError("--kv-memory-gb caps a growing pool; --num-blocks fixes its size: give one")
        config.cache = dataclasses.replace(config.cache, kv_memory_gb=kv_memory_gb)
    return config


@click.command()
@model_and_engine_options("sized from free memory", serving=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0 exposes the server to the network).",
)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--api-key",
    envvar="MLXPAGED_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health (env MLXPAGED_API_KEY).",
)
@click.option(
    "--max-queue",
    default=1024,
    show_default=True,
    type=click.IntRange(1),
    help="Requests waiting for admission before new ones get 503.",
)
@click.option(
    "--responses-store",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Responses kept in memory (LRU) for /v1/responses' previous_response_id; 0: stateless.",
)
@click.option(
    "--served-model-name",
    default=None,
    help="The model id of /v1/models (default: the checkpoint's folder or file name).",
)
@click.option(
    "--shutdown-timeout",
    default=5.0,
    show_default=True,
    help="Seconds SIGINT/SIGTERM lets running requests finish before aborting them.",
)
@click.option(
    "--kv-memory-gb",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Cap of the KV pool, which grows as blocks are needed and shrinks when idle (default: a quarter "
    "of free memory; --num-blocks fixes the pool instead).",
)
@click.option(
    "--kv-idle-trim",
    default=60.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds the server stays idle before a growing KV pool shrinks back, evicting cached blocks beyond "
    "its first chunk (0: as soon as it is idle). An agent's next turn within this time finds its history cached.",
)
@click.option(
    "--max-body-bytes",
    default=Limits.max_body_bytes,
    show_default=True,
    type=click.IntRange(1024),
    help="Larger request bodies get 413 before they are read.",
)
@click.option(
    "--max-stop-strings",
    default=Limits.max_stop_strings,
    show_default=True,
    type=click.IntRange(1, MAX_STOPS_CAP),
    help="Stop strings one request may give (OpenAI: 4).",
)
@click.option(
    "--max-request-tokens",
    default=Limits.max_request_tokens,
    show_default=True,
    type=click.IntRange(1),
    help="Largest prompts x n x max_tokens one request may ask for.",
)
@click.option(
    "--max-answer-bytes",
    default=Limits.max_answer_bytes,
    show_default=True,
    type=click.IntRange(1024),
    help="Largest estimated answer one request may ask for (prompts x n x (max_tokens + echo) x logprobs).",
)
@click.option(
    "--responses-store-bytes",
    default=Limits.responses_store_bytes,
    show_default=True,
    type=click.IntRange(0),
    help="Memory the stored Responses conversations' text may take, all together (with --responses-store).",
)
@click.option(
    "--stream-stall-timeout",
    default=Limits.stream_stall_timeout,
    show_default=True,
    type=click.FloatRange(0),
    help="Abort a request whose client stays behind its stream this many seconds (0: never).",
)
@click.option(
    "--max-images",
    default=Limits.max_images,
    show_default=True,
    type=click.IntRange(1),
    help="Images one request may carry (a vision model's).",
)
@click.option(
    "--max-image-bytes",
    default=Limits.max_image_bytes,
    show_default=True,
    type=click.IntRange(1),
    help="Largest image, in bytes (a data URL's decoded image, or a fetched one).",
)
@click.option(
    "--max-image-pixels",
    default=Limits.max_image_pixels,
    show_default=True,
    type=click.IntRange(1),
    help="Largest image, in pixels (width x height, read before it is decoded).",
)
@click.option(
    "--fetch-image-urls",
    is_flag=True,
    help="Fetch http(s) image URLs that requests name (any address this server can reach: trusted clients "
    "only); each within --max-image-bytes and --image-fetch-timeout. Off: only data URLs.",
)
@click.option(
    "--image-fetch-timeout",
    default=Limits.image_fetch_timeout,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds one image URL's fetch may take, all of it (with --fetch-image-urls).",
)
@click.option(
    "--content-special-tokens",
    is_flag=True,
    help="Encode special-token text in client messages as those tokens (trusted clients only: "
    "by default it is text, so no client can forge a turn).",
)
@click.option(
    "--max-connections",
    default=1024,
    show_default=True,
    type=click.IntRange(1),
    help="Open connections and requests at once; beyond it new requests get 503.",
)
@click.option(
    "--header-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(0.01),
    help="Close a connection whose request headers have not all arrived in this many seconds.",
)
@click.option(
    "--keep-alive-timeout",
    default=5.0,
    show_default=True,
    type=click.FloatRange(0.01),
    help="Close an idle keep-alive connection after this many seconds.",
)
@click.option(
    "--allowed-hosts",
    multiple=True,
    metavar="NAMES",
    help="Host names the server answers to besides its bound address, localhost and IP addresses "
    "(comma-separated or repeated; '*': any, for a LAN name behind --api-key). Others get 403: "
    "a DNS-rebinding web page reaches the server under its own name.",
)
@click.option(
    "--allowed-origins",
    multiple=True,
    metavar="ORIGINS",
    help="Web origins (http://host:port, comma-separated or repeated; '*': any) whose pages may call "
    "the server, with CORS headers so they can read the answers. Requests from other pages get 403.",
)
@click.option(
    "--max-web-viewers",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="Viewers of the web page's live cache view at once; beyond it they get 503.",
)
@click.option(
    "--max-memory",
    default=None,
    metavar="FRACTION|AMOUNT",
    help="With several --model: the memory the loaded models (weights and KV pools) may take together, a "
    "fraction of the RAM (0.75) or an amount (24GB); the least recently used idle model is unloaded to make "
    "room (default: 0.75).",
)
@click.option(
    "--max-loaded-models",
    default=None,
    type=click.IntRange(1),
    help="With several --model: models loaded at once (default: 3).",
)
@click.option(
    "--keep-alive",
    default=None,
    metavar="DURATION",
    help="With several --model: unload a model idle this long (seconds or 5m, 1h; negative: never; "
    "default: 5m). An Ollama request's keep_alive sets it for its model.",
)
@click.option(
    "--adapter",
    "adapters",
    multiple=True,
    metavar="NAME=PATH",
    help="A LoRA adapter (mlx_lm.lora's folder, or PEFT's) a request runs with as model 'MODEL:NAME' or "
    "adapters 'NAME'; repeatable. Rows of different adapters share each step.",
)
@click.option(
    "--adapter-dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="A folder of LoRA adapter folders: a request may name any of them (as with --adapter, by its "
    "folder's name), loaded when first named.",
)
@click.option("--enable-docs", is_flag=True, help="Serve /docs, /redoc and /openapi.json (off by default).")
@click.option("--no-web", is_flag=True, help="Do not serve the web page (/: chat and the live KV-cache view).")
@click.option(
    "--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]), show_default=True
)
def serve(
    model,
    dtype,
    weights,
    host,
    port,
    api_key,
    max_queue,
    responses_store,
    served_model_name,
    shutdown_timeout,
    kv_memory_gb,
    kv_idle_trim,
    max_body_bytes,
    max_stop_strings,
    max_request_tokens,
    max_answer_bytes,
    responses_store_bytes,
    stream_stall_timeout,
    max_images,
    max_image_bytes,
    max_image_pixels,
    fetch_image_urls,
    image_fetch_timeout,
    content_special_tokens,
    max_connections,
    header_timeout,
    keep_alive_timeout,
    allowed_hosts,
    allowed_origins,
    max_web_viewers,
    max_memory,
    max_loaded_models,
    keep_alive,
    adapters,
    adapter_dir,
    enable_docs,
    no_web,
    log_level,
    **engine_flags,
):
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /health, /metrics)
    and Anthropic's (/v1/messages, /v1/messages/count_tokens)."""
    if api_key is None and "MLXPAGED_API_KEY" in os.environ:  # click reads an empty variable as unset
        api_key = os.environ["MLXPAGED_API_KEY"]
    if api_key is not None:
        if not api_key.strip():  # `--api-key ""` or `MLXPAGED_API_KEY=`: never silently serve everyone
            fail(
                "the API key is empty (--api-key or MLXPAGED_API_KEY): give a key, "
                "or leave both unset to serve without one"
            )
        api_key = api_key.strip()
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        fail(f"`serve` needs {e.name}: install mlxpaged[serve] (pip install 'mlxpaged[serve]')")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    with user_errors():
        group, follower = launched_rank()  # under mlx.launch: tensor parallel; rank 0 serves HTTP, the others follow it
        config = serve_engine_config(engine_flags, kv_memory_gb)
    with user_errors():
        specs, pool_knobs = _models(model, served_model_name, group, max_memory, max_loaded_models, keep_alive)
        adapters = _adapters(adapters, len(specs), adapter_dir)
    if len(specs) == 1 and specs[0] is not None:  # NAME=PATH: one model served as NAME
        model, served_model_name = specs[0].source, served_model_name or specs[0].name
    elif specs == [None]:
        model = None
    make = lambda: _load_engine(model, dtype, weights, config, group, adapters, adapter_dir)  # noqa: E731
    if follower:
        return _follow(make, group)
    _check_port(host, port)
    if not api_key and not _is_loopback(host):
        click.echo(
            f"warning: listening on {host} without --api-key: anyone who can reach port {port} can use this server",
            err=True,
        )
    from .middleware import Browsers

    with user_errors():
        browsers = Browsers.of(host, _listed(allowed_hosts), _listed(allowed_origins))
    if not api_key and (browsers.hosts is None or "*" in browsers.origins):
        flag = "--allowed-hosts '*'" if browsers.hosts is None else "--allowed-origins '*'"
        click.echo(f"warning: {flag} without --api-key: any web page you visit can use this server", err=True)
    from .app import build_app, build_pool_app
    from .connections import header_timeout_protocol, raise_fd_limit
    from .engine_loop import EngineLoop
    from .metrics import Metrics

    metrics = Metrics()
    new_loop = lambda make_engine: EngineLoop(  # noqa: E731
        make_engine, observer=metrics, group=group, stall_timeout=stream_stall_timeout or None, idle_trim_s=kv_idle_trim
    )
    limits = Limits(
        max_body_bytes=max_body_bytes,
        max_stop_strings=max_stop_strings,
        max_request_tokens=max_request_tokens,
        max_answer_bytes=max_answer_bytes,
        responses_store_bytes=responses_store_bytes,
        stream_stall_timeout=stream_stall_timeout or None,
        enable_docs=enable_docs,
        content_special_tokens=content_special_tokens,
        max_images=max_images,
        max_image_bytes=max_image_bytes,
        max_image_pixels=max_image_pixels,
        fetch_image_urls=fetch_image_urls,
        image_fetch_timeout=image_fetch_timeout,
    )
    common = dict(
        api_key=api_key, max_queue=max_queue, limits=limits, responses_store=responses_store, browsers=browsers
    )
    engine_loop = pool = None
    if len(specs) > 1:  # several models (model_pool.py): the first loaded now, the others when asked
        from .model_pool import ModelPool

        configs = {spec: copy.deepcopy(config) for spec in specs}  # each engine its own, copied before any is built
        build = lambda spec: _build_model(spec, new_loop, dtype, weights, configs[spec], metrics, common)  # noqa: E731
        with user_errors():
            pool = ModelPool(specs, build, **pool_knobs)
    else:
        engine_loop = new_loop(make)
    # A failed load exits without interpreter teardown, which can abort ("terminate called without
    # an active exception", exit 134) once the engine thread has used MLX, as at shutdown (_exit_now).
    try:
        if pool is None:
            engine_loop.start()
        else:
            pool.load_now(pool.default)
            engine_loop = pool.default.loop
    except KeyboardInterrupt:  # the engine thread may still be loading: no waiting for it
        click.echo("interrupted while loading the model", err=True)
        _exit_now(130)
    except BaseException as e:
        if engine_loop is not None:
            engine_loop.stop()  # the thread has reported its error: it ends at once
        if isinstance(e, ValueError):  # MlxPagedError included: a refused model, a config that does not match
            click.echo(f"error: {e}", err=True)
        else:  # a bug, not bad input: the traceback says where
            import traceback

            traceback.print_exc()
        _exit_now(1)
    engine, loaded = engine_loop.engine, engine_loop.engine.loaded
    metrics.attach(engine_loop)
    if pool is None:
        model_id = served_model_name or loaded.path.name  # named by its --model value, else the default's folder
        aliases = {loaded.path.name, str(loaded.path), *([model] if model else [])}
        app = build_app(
            engine_loop,
            metrics,
            model_id=model_id,
            model_aliases=aliases,
            web=not no_web,
            max_web_viewers=max_web_viewers,
            **common,
        )
    else:
        model_id = pool.default.name
        app = build_pool_app(
            pool,
            metrics,
            api_key=api_key,
            limits=limits,
            web=not no_web,
            browsers=browsers,
            max_web_viewers=max_web_viewers,
        )
    raise_fd_limit()  # after loading: importing mlx_lm sets (2048, 4096)
    _announce(host, port, model_id, loaded, engine, api_key)
    if pool is not None:
        others = ", ".join(m.name for m in pool.models[1:])
        keep = "never" if pool.keep_alive == float("inf") else f"{pool.keep_alive:g} s"
        click.echo(
            f"  also serving {others}, each loaded when a request names it; memory budget "
            f"{pool.max_bytes / 1e9:.3f} GB, at most {pool.max_loaded} loaded, idle models unloaded after {keep}",
            err=True,
        )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=shutdown_timeout + 5,
        lifespan="on",
        loop="asyncio",
        http=header_timeout_protocol(header_timeout),
        limit_concurrency=max_connections,
        timeout_keep_alive=keep_alive_timeout,
    )

    class Server(uvicorn.Server):
        """SIGINT and SIGTERM alike: the first drains (new requests get 503, /health says "draining",
        running ones finish or are aborted after --shutdown-timeout), then uvicorn shuts down; a
        second signal shuts down at once."""

        draining = False

        def handle_exit(self, sig, frame):
            if not self.draining:
                self.draining = True
                (pool or engine_loop).drain(shutdown_timeout)
                return
            super().handle_exit(signal.SIGINT, frame)  # re-raised as KeyboardInterrupt after shutdown: exit 0

        async def on_tick(self, counter: int) -> bool:
            if self.draining and not self.should_exit and not (pool or engine_loop).busy:
                self.should_exit = True
            return await super().on_tick(counter)

    try:
        Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT once it has shut down cleanly
        pass
    click.echo("mlxpaged serve: stopped", err=True)
    _exit_now()  # everything is shut down; interpreter teardown could only crash (see _exit_now)


def _models(values, served_model_name, group, max_memory, max_loaded_models, keep_alive):
    """The `--model` values as `ModelSpec`s ([None]: the offline default model), and the pool's
    knobs; the pool's flags need several models."""
    from .model_pool import DEFAULT_KEEP_ALIVE, DEFAULT_MAX_LOADED, ModelSpec, duration_seconds, memory_budget

    specs = [ModelSpec.parse(v) for v in values] or [None]
    knobs = {"--max-memory": max_memory, "--max-loaded-models": max_loaded_models, "--keep-alive": keep_alive}
    if len(specs) == 1:
        given = [k for k, v in knobs.items() if v is not None]
        if given:
            raise ValueError(f"{given[0]} applies to a server of several models: give --model more than once")
        return specs, {}
    if served_model_name is not None:
        raise ValueError("--served-model-name names one model: with several, give each as --model NAME=PATH_OR_REPO")
    if group is not None:
        raise ValueError("a tensor-parallel server serves one model: give --model once")
    for spec in specs:
        local = Path(spec.source).expanduser()
        if (spec.source.startswith((".", "/", "~")) or local.suffix == ".gguf") and not local.exists():
            raise ValueError(f"--model {spec.source}: no such file or directory")
    seconds = DEFAULT_KEEP_ALIVE if keep_alive is None else duration_seconds(keep_alive)
    if seconds is None:
        raise ValueError(f"--keep-alive: '{keep_alive}' is not a duration (seconds, or e.g. 5m, 1h30m, -1)")
    return specs, {
        "max_bytes": memory_budget(max_memory),
        "max_loaded": max_loaded_models or DEFAULT_MAX_LOADED,
        "keep_alive": seconds,
    }


def _build_model(spec, new_loop, dtype, weights, config, metrics, common):
    """One model of a server of several (run off the event loop): its started engine loop, its
    routes, its card and its bytes."""
    from .app import build_app
    from .model_pool import footprint
    from .models_api import served_catalog

    loop = new_loop(lambda: _load_engine(spec.source, dtype, weights, config))
    try:
        loop.start()
    except BaseException:
        loop.stop()
        raise
    loaded = loop.engine.loaded
    aliases = {spec.source, loaded.path.name, str(loaded.path)}
    app = build_app(loop, metrics, model_id=spec.name, model_aliases=aliases, web=False, guarded=False, **common)
    return loop, app, served_catalog(app.state.server).cards()[0], footprint(loop.engine)


def _listed(values: tuple[str, ...]) -> list[str]:
    """A repeated flag's values, each possibly comma-separated."""
    return [v for value in values for v in value.split(",") if v.strip()]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _load_engine(model, dtype, weights, config, group=None, adapters=None, adapter_dir=None):
    """The engine `serve` runs: the whole model here, or this rank's shard under mlx.launch; an
    encoder checkpoint's backend (engine/encoder.py) for an embedding model or cross-encoder
    (the builder tells which from the checkpoint)."""
    from ..engine.builder import build_engine

    return build_engine(
        model,
        config,
        dtype=dtype,
        weights=weights,
        group=group,
        adapters=adapters,
        adapter_dir=adapter_dir,
        encoders=True,
    )


def _adapters(values: tuple[str, ...], num_models: int, adapter_dir: str | None) -> dict[str, str] | None:
    """The `--adapter NAME=PATH` values by name (checked against the model when it loads)."""
    if (values or adapter_dir) and num_models > 1:
        flag = "--adapter" if values else "--adapter-dir"
        raise ValueError(f"{flag} applies to a server of one model: give --model once")
    if not values:
        return None
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--adapter {value}: give NAME=PATH (the folder mlx_lm.lora wrote)")
        if name in out:
            raise ValueError(f"--adapter: the name '{name}' is given twice")
        out[name.strip()] = path.strip()
    return out


def _follow(make_engine, group) -> None:
    """A rank other than 0 of a tensor-parallel server: no HTTP; replay rank 0's steps until it stops."""
    from .engine_loop import follow

    with user_errors():
        engine = make_engine()
    click.echo(f"mlxpaged serve: rank {group.rank()} of {group.size()} following rank 0", err=True)
    follow(engine, group)
    click.echo(f"mlxpaged serve: rank {group.rank()} stopped", err=True)
    _exit_now()


def _exit_now(code: int = 0) -> None:
    """Exit with `code` without interpreter teardown: MLX, used from the engine thread (and its ring
    backend under tensor parallelism), can abort the process ("terminate called without an active
    exception") while Python finalizes; seen after a drained shutdown of a one-process server, and
    after a model that failed to load on the engine thread."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _announce(host, port, model_id, loaded, engine, api_key) -> None:
    from ..attention import resolve_impl
    from ..engine.encoder import EncoderEngine

    if isinstance(engine, EncoderEngine):  # no KV pool, no attention choice: what it computes
        what = "cross-encoder (rerank)" if loaded.task == "score" else f"embeddings ({loaded.pooling} pooling)"
        click.echo(
            f"mlxpaged serve: http://{host}:{port}/v1  model {model_id} ({loaded.path}, {loaded.dtype})\n"
            f"  encoder model run by mlx-embeddings: {what}, up to {loaded.context} tokens an input; "
            f"auth: {'API key' if api_key else 'none'}",
            err=True,
        )
        return
    bs = engine.config.cache.block_size
    cfg = engine.config
    kv = f" ({cfg.cache.kv_bits}-bit K/V, group {cfg.cache.kv_group_size})" if cfg.cache.kv_bits else ""
    cap = engine.max_blocks
    grows = (
        f", grows to {cap} blocks ({cap * engine.kv_cache.shape.bytes_per_block(bs) / 1e9:.3f} GB) as needed"
        if cap > engine.num_blocks
        else ""
    )
    click.echo(
        f"mlxpaged serve: http://{host}:{port}/v1  model {model_id} ({loaded.path}, {loaded.dtype})\n"
        f"  KV pool: {engine.num_blocks} blocks x {bs} tokens = {engine.num_blocks * bs} tokens, "
        f"{engine.kv_cache.nbytes / 1e9:.3f} GB{kv}{grows}; attention: {resolve_impl(engine.config.attention_impl)}; "
        f"prefix caching: {'on' if engine.config.cache.enable_prefix_caching else 'off'}; "
        f"auth: {'API key' if api_key else 'none'}",
        err=True,
    )
