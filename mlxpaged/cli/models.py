"""`mlxpaged pull`, `ls` and `rm`: the models on this machine.

`pull REPO` downloads a Hugging Face repo's checkpoint files (the ones the loader reads: mlx-lm's
`DEFAULT_ALLOW_PATTERNS`) into the Hugging Face cache through `huggingface_hub.snapshot_download`,
which draws the progress bars and resumes an interrupted download. `serve --model REPO` and
`generate --model REPO` then load it from there without a network. With `HF_HUB_OFFLINE=1` a
model already in the cache is found, and one that is not is named in one line (exit 1).

`ls` lists, without any network, the model repos in the Hugging Face cache
(`huggingface_hub.scan_cache_dir`) and the checkpoints mlxpaged converted from GGUF files (under
`$MLXPAGED_CACHE/converted`): name, size on disk, kind (text, vision, embeddings), quantization
and context length, read from each one's files (`loading.catalog.describe`). `rm NAME` deletes
one of them (every cached revision of a repo).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from ..loading.catalog import describe


@dataclass(frozen=True)
class LocalModel:
    """One model on disk: a Hugging Face cache repo (`where` "hf") or a checkpoint converted from a
    GGUF file ("converted"). `path`: the folder that loads (a repo's newest snapshot)."""

    name: str
    where: str
    path: Path
    size_bytes: int
    kind: str
    quantization: str | None
    context: int | None


def fail(message: str) -> None:
    click.echo(f"mlxpaged: {message}", err=True)
    sys.exit(1)


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def hf_models() -> list[LocalModel]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        d = describe(newest.snapshot_path)
        out.append(
            LocalModel(repo.repo_id, "hf", newest.snapshot_path, repo.size_on_disk, d.kind, d.quantization, d.context)
        )
    return out


def converted_name(folder: Path) -> str:
    """A converted checkpoint's name: its GGUF file's stem, with the folder's variant (`-quantized`,
    `-float32`) after it."""
    try:
        source = json.loads((folder / "mlxpaged_conversion.json").read_text()).get("source") or ""
    except (OSError, ValueError):
        source = ""
    stem = Path(source).stem or folder.name
    variant = folder.name.partition("-")[2]
    return f"{stem}-{variant}" if variant else stem


def converted_models() -> list[LocalModel]:
    from ..loading.gguf.convert import cache_root

    root = cache_root() / "converted"
    out = []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if not (folder / "config.json").is_file():
            continue  # a conversion that did not finish
        d = describe(folder)
        out.append(
            LocalModel(converted_name(folder), "converted", folder, d.size_bytes, d.kind, d.quantization, d.context)
        )
    return out


def local_models() -> list[LocalModel]:
    return hf_models() + converted_models()


@click.command()
@click.argument("repo")
@click.option("--revision", default=None, help="A branch, tag or commit (default: main).")
def pull(repo: str, revision: str | None):
    """Download a Hugging Face model repo (owner/name) into the Hugging Face cache, resumably."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if repo.count("/") != 1 or repo.startswith(("/", ".", "~")):
        fail(f"pull: '{repo}' is not a Hugging Face repo id (owner/name)")
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS  # the files the loader reads, and no others

    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except GatedRepoError:
        fail(f"pull: '{repo}' is gated: accept its terms on huggingface.co and log in (hf auth login)")
    except RepositoryNotFoundError:
        fail(f"pull: no model repo '{repo}' on the Hugging Face hub (or it is private: log in with hf auth login)")
    except RevisionNotFoundError:
        fail(f"pull: '{repo}' has no revision '{revision}'")
    except LocalEntryNotFoundError:
        if offline:
            fail(f"pull: '{repo}' is not in the Hugging Face cache, and HF_HUB_OFFLINE=1 forbids downloading it")
        fail(f"pull: cannot reach the Hugging Face hub to download '{repo}' (and it is not in the cache)")
    except (HfHubHTTPError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(f"pull: cannot download '{repo}': {reason[:200]}")
    if not (path / "config.json").is_file():
        fail(f"pull: '{repo}' has no config.json: it is not a checkpoint mlxpaged loads ({path})")
    d = describe(path)
    quant = f", {d.quantization}" if d.quantization else ""
    click.echo(f"{repo}: {human(d.size_bytes)}, {d.kind}{quant} at {path}")


@click.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per model, one a line.")
def ls(as_json: bool):
    """List the models on this machine: the Hugging Face cache and mlxpaged's GGUF conversions."""
    models = local_models()
    if as_json:
        for m in models:
            row = {"name": m.name, "where": m.where, "path": str(m.path), "size": m.size_bytes, "kind": m.kind}
            click.echo(json.dumps(row | {"quantization": m.quantization, "context": m.context}))
        return
    rows = [("NAME", "SIZE", "KIND", "QUANTIZATION", "CONTEXT", "WHERE")] + [
        (m.name, human(m.size_bytes), m.kind, m.quantization or "-", str(m.context or "-"), m.where) for m in models
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@click.command()
@click.argument("name")
def rm(name: str):
    """Delete a model listed by `mlxpaged ls` (every cached revision of a Hugging Face repo)."""
    found = [m for m in local_models() if m.name == name]
    if not found:
        fail(f"rm: no model '{name}' on this machine (mlxpaged ls lists them)")
    for m in found:
        if m.where == "hf":
            from huggingface_hub import scan_cache_dir

            info = scan_cache_dir()
            repo = next(r for r in info.repos if r.repo_id == name and r.repo_type == "model")
            info.delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
            shutil.rmtree(repo.repo_path, ignore_errors=True)  # refs and the tree cache left behind
        else:
            shutil.rmtree(m.path)
        click.echo(f"deleted {name} ({human(m.size_bytes)}, {m.where})")
