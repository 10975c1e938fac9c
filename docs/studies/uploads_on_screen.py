"""The part page_time.py and page_floor.py share: serve a Streamlit page, open it in headless Chromium (Debian's
chromium, playwright), give its upload box each photo in turn and time each until its text is on the page."""
import os, socket, subprocess, sys, time, urllib.request
from pathlib import Path
from typing import Callable
from playwright.sync_api import sync_playwright

PHOTOS = [Path("../shared/data/coco-paired/images") / l.strip()
          for l in open("../shared/data/coco-paired/split_val.txt")][60:70]  # the same 10 in both studies


def seconds_to_screen(page_file: Path, ready: list[str], shown: Callable[[Path], str], box: str = 'input[type="file"]',
                      env: dict | None = None) -> list[float]:
    """Each photo's seconds from the upload to shown(photo) on the page, once any of `ready` is on it."""
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(page_file), "--server.headless", "true",
                             "--server.port", str(port), "--server.address", "127.0.0.1",
                             "--browser.gatherUsageStats", "false"],
                            env=dict(os.environ, **(env or {})), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read().strip() == b"ok": break
        except OSError: pass
        time.sleep(0.3)
    out = []
    try:
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = b.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            first = page.get_by_text(ready[0])
            for text in ready[1:]:
                first = first.or_(page.get_by_text(text))
            first.first.wait_for(timeout=120000)
            time.sleep(3)
            for p in PHOTOS:
                data = p.read_bytes()
                t = time.perf_counter()
                page.locator(box).set_input_files(files=[{"name": p.name, "mimeType": "image/jpeg", "buffer": data}])
                page.get_by_text(shown(p)).first.wait_for(state="attached", timeout=60000)
                out.append(time.perf_counter() - t)
                time.sleep(2)
            b.close()
    finally:
        proc.terminate(); proc.wait(10)
    return out
