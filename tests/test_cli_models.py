"""`mlxpaged pull`, `ls` and `rm` against a local, file-based stand-in of the Hugging Face hub.

The stand-in speaks the three endpoints `huggingface_hub.snapshot_download` uses (a revision's
info, its file tree, each file's `resolve` URL with ranges) on loopback, from files in memory;
no test touches the network. `huggingface_hub` reads its endpoint, cache and offline switch when
it is imported, so the commands run in a subprocess per environment (through click's runner).
References: the bytes served, the files on disk (`os.stat`), the configs the test wrote.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mlxpaged.loading.catalog import describe

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-chat"
DRIVER = """
import json, sys
from click.testing import CliRunner
from mlxpaged.cli.main import main
out = []
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(main, args)
    crash = r.exception is not None and not isinstance(r.exception, SystemExit)
    crash = repr(r.exception) if crash else None
    out.append({"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "crash": crash})
print("RESULTS" + json.dumps(out))
"""


class Hub:
    """A model repo served as the hub serves it; `ranges` records each ranged GET (file, first byte).
    The first GET of a file in `cut` drops the connection after `CUT_AT` bytes."""

    CUT_AT = 11_000_000  # past huggingface_hub's first 10 MiB chunk, which it keeps

    def __init__(self, files: dict[str, bytes], cut: set[str] = frozenset()):
        self.files, self.ranges, self.cut = files, [], set(cut)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def route(self, head: bool):
                path = self.path.split("?", 1)[0]
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
                    if m.group(1) != REPO:
                        return self.send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, head)
                    info = {"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": f} for f in hub.files]}
                    return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
                    tree = [
                        {"type": "file", "oid": hub.oid(f), "size": len(data), "path": f}
                        for f, data in hub.files.items()
                    ]
                    return self.send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
                if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    data = hub.files.get(m.group(3))
                    if m.group(1) != REPO or data is None:
                        return self.send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hub.oid(m.group(3))}"'}
                    start = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "") or "")
                    if start and not head:
                        first = int(start.group(1))
                        hub.ranges.append((m.group(3), first))
                        headers["Content-Range"] = f"bytes {first}-{len(data) - 1}/{len(data)}"
                        return self.send(206, data[first:], headers)
                    if m.group(3) in hub.cut and not head:  # a connection lost mid-file
                        hub.cut.discard(m.group(3))
                        self.send_response(200)
                        for k, v in (headers | {"Content-Length": str(len(data))}).items():
                            self.send_header(k, v)
                        self.end_headers()
                        self.wfile.write(data[: hub.CUT_AT])
                        self.close_connection = True
                        return None
                    return self.send(200, data, headers, head)
                return self.send(404, b"", {}, head)

            def do_GET(self):
                self.route(False)

            def do_HEAD(self):
                self.route(True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def oid(self, name: str) -> str:
        return hashlib.sha1(self.files[name]).hexdigest()


@pytest.fixture
def hub(tiny_model_path):
    files = {p.name: p.read_bytes() for p in tiny_model_path.iterdir() if p.is_file()}
    files["README.md"] = b"# not a file the loader reads\n"
    # a second weights shard, big enough for a download to be cut and resumed (never loaded here)
    files["model-2.safetensors"] = hashlib.sha256(b"w").digest() * 375_000
    h = Hub(files, cut={"model-2.safetensors"})
    yield h
    h.server.shutdown()


def cli(tmp_path: Path, commands: list[list[str]], **env) -> list[dict]:
    base = {
        "HF_HOME": str(tmp_path / "hf"),
        "MLXPAGED_CACHE": str(tmp_path / "mlxpaged"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "PATH": "/usr/bin:/bin",
    }
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(commands)],
        env=base | env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "RESULTS" in r.stdout, r.stderr[-3000:]
    results = json.loads(r.stdout.split("RESULTS", 1)[1])
    for res in results:
        assert res["crash"] is None and "Traceback" not in res["stderr"], res
    return results


def test_pull_resumes_lists_and_removes(hub, tmp_path, tiny_model_path):
    blobs = tmp_path / "hf" / "hub" / "models--acme--tiny-chat" / "blobs"
    # a checkpoint converted from a GGUF file, kept quantized
    conv = tmp_path / "mlxpaged" / "converted" / "0123456789abcdef-quantized"
    conv.mkdir(parents=True)
    (conv / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 32768}))
    types = {"F32": 121, "Q5_0": 133, "Q8_0": 13}
    source = {"source": "/x/qwen2.5-coder-0.5b.gguf", "tensor_types": types}
    (conv / "mlxpaged_conversion.json").write_text(json.dumps(source | {"weights": "quantized"}))
    dequantized = conv.parent / "0123456789abcdef"  # the same GGUF dequantized to float16
    shutil.copytree(conv, dequantized)
    (dequantized / "mlxpaged_conversion.json").write_text(json.dumps(source | {"weights": "float", "dtype": "float16"}))

    pulled, listed = cli(tmp_path, [["pull", REPO], ["ls", "--json"]], HF_ENDPOINT=hub.url)
    assert pulled["code"] == 0, pulled
    # the lost download resumed from what it had kept, not from the start
    ((name, first),) = hub.ranges
    assert name == "model-2.safetensors" and 0 < first <= hub.CUT_AT
    snap = tmp_path / "hf" / "hub" / "models--acme--tiny-chat" / "snapshots" / COMMIT
    got = {p.name: p.read_bytes() for p in snap.iterdir()}
    assert got == {k: v for k, v in hub.files.items() if k != "README.md"}  # the loader's files only
    assert str(snap) in pulled["stdout"]

    rows = {r["name"]: r for r in map(json.loads, listed["stdout"].splitlines())}
    config = json.loads((tiny_model_path / "config.json").read_text())
    on_disk = sum(p.stat().st_size for p in blobs.iterdir())
    assert rows[REPO] | {"path": None} == {
        "name": REPO,
        "where": "hf",
        "path": None,
        "size": on_disk,
        "kind": "text",
        "quantization": "F32",
        "context": config["max_position_embeddings"],
    }
    assert rows["qwen2.5-coder-0.5b-quantized"]["quantization"] == "Q5_0+Q8_0"
    assert rows["qwen2.5-coder-0.5b-quantized"]["where"] == "converted"
    assert rows["qwen2.5-coder-0.5b"]["quantization"] == "F16"

    # offline: what is cached is found; what is not is named in one line, exit 1
    here, missing = cli(tmp_path, [["pull", REPO], ["pull", "acme/not-here"]], HF_HUB_OFFLINE="1")
    assert here["code"] == 0 and str(snap) in here["stdout"]
    assert missing["code"] == 1 and missing["stderr"].count("\n") == 1
    assert "acme/not-here" in missing["stderr"] and "HF_HUB_OFFLINE" in missing["stderr"]

    unknown, gone, bad, removed, after = cli(
        tmp_path,
        [["pull", "acme/nope"], ["rm", "acme/nope"], ["pull", "not-a-repo"], ["rm", REPO], ["ls"]],
        HF_ENDPOINT=hub.url,
    )
    assert unknown["code"] == 1 and "acme/nope" in unknown["stderr"] and unknown["stderr"].count("\n") == 1
    assert gone["code"] == 1 and "acme/nope" in gone["stderr"]
    assert bad["code"] == 1 and "owner/name" in bad["stderr"]
    assert removed["code"] == 0 and not (tmp_path / "hf" / "hub" / "models--acme--tiny-chat").exists()
    assert REPO not in after["stdout"] and "qwen2.5-coder-0.5b-quantized" in after["stdout"]
    assert after["stdout"].splitlines()[0].split() == ["NAME", "SIZE", "KIND", "QUANTIZATION", "CONTEXT", "WHERE"]


@pytest.mark.parametrize(
    "config, kind, quantization",
    [
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16"}, "text", "BF16"),
        (
            {"model_type": "qwen2_5_vl", "vision_config": {}, "quantization": {"group_size": 64, "bits": 4}},
            "vision",
            "Q4 (group 64)",
        ),
        ({"model_type": "bert", "architectures": ["BertModel"], "torch_dtype": "float32"}, "embeddings", "F32"),
        ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "text", None),
    ],
)
def test_describe_reads_kind_and_quantization_from_config(tmp_path, config, kind, quantization):
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "w.bin").write_bytes(b"x" * 123)
    d = describe(tmp_path)
    assert (d.kind, d.quantization, d.family) == (kind, quantization, config["model_type"])
    assert d.size_bytes == 123 + (tmp_path / "config.json").stat().st_size
