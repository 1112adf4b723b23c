"""A `mlxpaged serve` subprocess on a checkpoint, for the server tests: start, wait ready, metrics, stop."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from mlxpaged.testing.slowness import wall


# -- an app in this process --------------------------------------------------------------------
def in_process_app(loaded, num_blocks: int = 64):
    """(app, its engine loop, started, with /metrics attached) over `loaded` in this process."""
    import mlx.core as mx

    from mlxpaged.config import EngineConfig
    from mlxpaged.engine.llm_engine import LLMEngine
    from mlxpaged.server.app import build_app
    from mlxpaged.server.engine_loop import EngineLoop
    from mlxpaged.server.metrics import Metrics

    mx.eval(loaded.model.parameters())
    metrics = Metrics()
    loop = EngineLoop(lambda: LLMEngine(loaded, EngineConfig.of(num_blocks=num_blocks)), observer=metrics)
    loop.start()
    metrics.attach(loop)
    return build_app(loop, metrics, model_id="tiny"), loop


# -- a server subprocess ----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args: str, timeout: float = 60.0, env: dict | None = None, preexec_fn=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # with a key, /metrics needs it too
        self.headers = {"Authorization": f"Bearer {args[args.index('--api-key') + 1]}"} if "--api-key" in args else {}
        cmd = [
            sys.executable,
            "-m",
            "mlxpaged.cli",
            "serve",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *args,
        ]
        # stderr to a file, not a pipe: a server that logs a lot must never block on a full pipe
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=env, preexec_fn=preexec_fn
        )
        deadline = time.monotonic() + wall(timeout)  # `timeout`: on a quiet machine
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.stderr()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not come up")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=wall(5), headers=self.headers).text
        return {
            k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))
        }

    def stderr(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def interrupt(self, timeout: float = 20.0, sig: int = signal.SIGINT) -> tuple[int, str]:
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=wall(timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode, self.stderr()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
