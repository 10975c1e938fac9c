"""Study (docs/performance.md, "The app: a photo's caption on screen"): the floor of any Streamlit page here. A bare
page (one upload box; on a photo it sleeps SECONDS, standing in for caption(), and writes one line) in headless
Chromium, the same 10 coco-paired val photos as page_time.py: upload to the line on screen. Run from the repository
root: .venv/bin/python docs/studies/page_floor.py [SECONDS] (about half a minute)."""
import statistics, sys, tempfile
from pathlib import Path
from uploads_on_screen import PHOTOS, seconds_to_screen

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
page = Path(tempfile.mkdtemp()) / "bare.py"
page.write_text(PAGE.replace("SECONDS", repr(seconds)))
shown = seconds_to_screen(page, ["waiting"], lambda p: f"“the line of {p.name}”")
print(f"sleep {1000 * seconds:.0f} ms: on screen p50 {1000 * statistics.median(shown):.0f} ms "
      f"(min {1000 * min(shown):.0f}, max {1000 * max(shown):.0f}) over {len(PHOTOS)} photos")
