"""Study (the caption first): a photo uploaded in headless Chromium (Debian's chromium, playwright) until its caption
is on the page, against caption() of the same 10 coco-paired val photos, 2 threads. Run from the repository root:
.venv/bin/python docs/studies/page_time.py (about a minute)."""
import statistics, time
from pathlib import Path
import torch
torch.set_num_threads(2)
import captioner
from uploads_on_screen import PHOTOS, seconds_to_screen

m = captioner.load()
m.caption(PHOTOS[0])
api, texts = [], {}
for p in PHOTOS:
    t = time.perf_counter(); c = m.caption(p); api.append(time.perf_counter() - t); texts[p] = c.text
shown = seconds_to_screen(Path("app.py"), ["Sure: ", "likely to be a good"], lambda p: f"“{texts[p]}”",
                          box='input[type="file"]:not([multiple])', env={"OMP_NUM_THREADS": "2"})
ratios = [s / a for s, a in zip(shown, api)]
print(f"caption() p50 {1000*statistics.median(api):.0f} ms; on screen p50 {1000*statistics.median(shown):.0f} ms "
      f"(min {1000*min(shown):.0f}, max {1000*max(shown):.0f}); ratio p50 {statistics.median(ratios):.1f}x "
      f"(min {min(ratios):.1f}, max {max(ratios):.1f}) over {len(PHOTOS)} photos")
