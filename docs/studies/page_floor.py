"""Study (docs/performance.md, "The app: a photo's caption on screen"): the floor of any Streamlit page here. A bare
page (one upload box; on a photo it sleeps SECONDS, standing in for caption(), and writes one line) in headless
Chromium (Debian's chromium, playwright), the same 10 coco-paired val photos as page_time.py: upload to the line on
screen. Run from the repository root: .venv/bin/python docs/studies/page_floor.py [SECONDS] (about half a minute)."""
import os, socket, statistics, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
from playwright.sync_api import sync_playwright

PAGE = '''import time, streamlit as st
f = st.file_uploader("photo", type=["jpg"])
if f is None:
    st.write("waiting")
else:
    f.getvalue()
    time.sleep(SECONDS)
    st.markdown(f"“the line of {f.name}”")
'''
seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
names = [l.strip() for l in open("../shared/data/coco-paired/split_val.txt")][60:70]
paths = [Path("../shared/data/coco-paired/images") / n for n in names]
app = Path(tempfile.mkdtemp()) / "bare.py"
app.write_text(PAGE.replace("SECONDS", repr(seconds)))
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(app), "--server.headless", "true", "--server.port",
                         str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
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
        page.get_by_text("waiting").first.wait_for(timeout=120000)
        time.sleep(3)
        for p in paths:
            t = time.perf_counter()
            page.locator('input[type="file"]').set_input_files(files=[{"name": p.name, "mimeType": "image/jpeg", "buffer": p.read_bytes()}])
            page.get_by_text(f"“the line of {p.name}”").first.wait_for(state="attached", timeout=60000)
            shown.append(time.perf_counter() - t)
            time.sleep(2)
        b.close()
finally:
    proc.terminate(); proc.wait(10)
print(f"sleep {1000 * seconds:.0f} ms: on screen p50 {1000 * statistics.median(shown):.0f} ms "
      f"(min {1000 * min(shown):.0f}, max {1000 * max(shown):.0f}) over {len(paths)} photos")
