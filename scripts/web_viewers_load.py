"""Many viewers of the web page's live cache view: what they cost everyone else.

One `mlxpaged serve` on the tiny random checkpoint with a 4,096-block pool and an n=8 completion
stream running throughout (200 tokens each, EOS ignored, sent again as each ends); VIEWERS
clients open `/web/cache` (server-sent events) at once and read it for SECONDS while `/health`
is timed every 0.05 s on one kept-alive connection. Prints /health's median and worst time, the
viewers served and refused, and the bytes they were sent. Extra arguments go to `serve`.

    python scripts/web_viewers_load.py [VIEWERS=200] [SECONDS=15] [serve flags, e.g. --max-web-viewers 200]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

import mlxpaged  # noqa: F401  (first: it points MLX at the system OpenBLAS before MLX loads)
from mlxpaged.testing.tiny_model import write_tiny_qwen2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_proc import Server  # noqa: E402


def main() -> None:
    viewers = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 15.0
    server = Server(write_tiny_qwen2(Path(tempfile.mkdtemp())), "--num-blocks", "4096", *sys.argv[3:])
    stop = threading.Event()
    status, received = [None] * viewers, [0] * viewers

    def view(i: int) -> None:
        try:  # read timeout: an idle engine sends no more pictures
            with httpx.stream("GET", server.url + "/web/cache", timeout=httpx.Timeout(60, read=5)) as r:
                status[i] = r.status_code
                for chunk in r.iter_raw():
                    received[i] += len(chunk)
                    if stop.is_set():
                        return
        except httpx.HTTPError as e:
            status[i] = status[i] or type(e).__name__

    def generate() -> None:
        client = server.client()
        model = client.models.list().data[0].id
        while not stop.is_set():
            client.completions.create(
                model=model, prompt="hello " * 40, n=8, max_tokens=200, extra_body={"ignore_eos": True}
            )

    probe = httpx.Client(timeout=60)

    def timed() -> float:
        t0 = time.monotonic()
        assert probe.get(server.url + "/health").status_code == 200
        return time.monotonic() - t0

    try:
        gen = threading.Thread(target=generate)
        gen.start()
        time.sleep(1.0)
        threads = [threading.Thread(target=view, args=(i,)) for i in range(viewers)]
        for t in threads:
            t.start()
        times, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            times.append(timed())
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join()
        gen.join()
        print(
            f"{viewers} viewers, {seconds:.0f} s: /health median {statistics.median(times) * 1e3:.1f} ms, "
            f"worst {max(times) * 1e3:.0f} ms ({len(times)} probes); served {status.count(200)}, "
            f"refused {status.count(503)}; {sum(received) / 1e6:.1f} MB sent to viewers"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
