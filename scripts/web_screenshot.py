"""Take docs/web.png: the server's page mid-run, in headless Chromium (the browser the tests use).

Two chat requests share a system prompt (a prefix): the page's own, with n=4, and one sent by
the `openai` client meanwhile; the screenshot is taken while both run and the first has forked.

    python scripts/web_screenshot.py [--model M] [--out docs/web.png]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

SYSTEM = (
    "You are a concise assistant on a laptop. Answer in plain sentences, without lists or headings, "
    "and keep every answer under a hundred words. Prefer concrete examples to general statements."
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: the offline default model)")
    ap.add_argument("--served-model-name", default="Qwen2.5-Coder-0.5B-Instruct", help="'' for the default name")
    ap.add_argument("--out", default="docs/web.png")
    ap.add_argument("--port", type=int, default=8765)
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "mlxpaged.cli", "serve", "--port", str(a.port), "--num-blocks", "96"]
    cmd += ["--log-level", "warning"] + (["--model", a.model] if a.model else [])
    cmd += ["--served-model-name", a.served_model_name] if a.served_model_name else []
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{a.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        opts = webdriver.ChromeOptions()
        opts.binary_location = "/usr/bin/chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1500,1100"):
            opts.add_argument(arg)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        driver.get(url + "/")
        time.sleep(2)
        set_value = "document.getElementById(arguments[0]).value = arguments[1];"
        for field, value in (("system", SYSTEM), ("n", "4"), ("temperature", "0.8"), ("max-tokens", "160")):
            driver.execute_script(set_value, field, value)
        driver.execute_script(set_value, "prompt", "Why does a KV cache need memory management?")
        driver.find_element(By.ID, "send").click()
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        time.sleep(1.0)  # the page's request is admitted first; the second finds its prefix cached
        other = threading.Thread(
            target=lambda: client.chat.completions.create(
                model=model,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a page table?"}],
                max_tokens=160,
            )
        )
        other.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            reqs = driver.execute_script(
                "return [...document.querySelectorAll('#requests .req .head')].map(h => h.textContent)"
            )
            texts = driver.execute_script(
                "return [...document.querySelectorAll('.answer .text')].map(t => t.textContent)"
            )
            if len(reqs) >= 2 and any("forked" in r for r in reqs) and min(map(len, texts or [""])) > 120:
                break
            time.sleep(0.2)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(a.out)
        print("wrote", a.out, "requests:", reqs)
        driver.quit()
        other.join()
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
