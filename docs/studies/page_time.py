"""Study (the caption first): a photo uploaded in headless Chromium (Debian's chromium, playwright) until its caption
is on the page, against caption() of the same 10 coco-paired val photos, 2 threads. Run from the repository root:
.venv/bin/python docs/studies/page_time.py (about a minute)."""
import os, socket, statistics, subprocess, sys, time, urllib.request
from pathlib import Path
import torch
torch.set_num_threads(2)
import captioner
from playwright.sync_api import sync_playwright
ROOT = Path(".")
names = [l.strip() for l in open("../shared/data/coco-paired/split_val.txt")][60:70]
paths = [Path("../shared/data/coco-paired/images") / n for n in names]
m = captioner.load()
m.caption(paths[0])
api = []
texts = []
for p in paths:
    t = time.perf_counter(); c = m.caption(p); api.append(time.perf_counter() - t); texts.append(c.text)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
env = dict(os.environ, OMP_NUM_THREADS="2")
proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port",
                         str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"],
                        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
url = f"http://127.0.0.1:{port}"
for _ in range(200):
    try:
        if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read().strip() == b"ok": break
    except OSError: pass
    time.sleep(0.3)
shown = []
try:
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = b.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        page.get_by_text("Sure: ").or_(page.get_by_text("likely to be a good")).first.wait_for(timeout=120000)
        time.sleep(3)
        for p, text in zip(paths, texts):
            data = p.read_bytes()
            t = time.perf_counter()
            page.locator('input[type="file"]:not([multiple])').set_input_files(files=[{"name": p.name, "mimeType": "image/jpeg", "buffer": data}])
            page.get_by_text(f"“{text}”").first.wait_for(state="attached", timeout=60000)
            shown.append(time.perf_counter() - t)
            time.sleep(2)
        b.close()
finally:
    proc.terminate(); proc.wait(10)
ratios = [s / a for s, a in zip(shown, api)]
print(f"caption() p50 {1000*statistics.median(api):.0f} ms; on screen p50 {1000*statistics.median(shown):.0f} ms "
      f"(min {1000*min(shown):.0f}, max {1000*max(shown):.0f}); ratio p50 {statistics.median(ratios):.1f}x "
      f"(min {min(ratios):.1f}, max {max(ratios):.1f}) over {len(paths)} photos")
