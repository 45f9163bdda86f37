"""Render a page in headless Chromium the way a person would open it, and report what they would see.

A copy of the page gets a probe script as the first thing in <head>: it records every error event (uncaught
exceptions, resources that failed to load) and `console.error` calls, and after `load` writes, into the DOM, each
figure's drawn size and position and each finding title's size. `--dump-dom` returns that; Chromium's own log
(`--enable-logging=stderr`) adds every console message the page printed. Then a screenshot of the original page.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

_PROBE = """<script>
window.__probe = [];
window.addEventListener("error", function (e) {
  window.__probe.push(e.message || ("failed to load " + (e.target && (e.target.src || e.target.href))));
}, true);
var __consoleError = console.error;
console.error = function () { window.__probe.push(Array.prototype.join.call(arguments, " ")); };
window.addEventListener("load", function () {
  var box = function (el) {
    var r = el.getBoundingClientRect();
    return {w: r.width, h: r.height, x: r.left + window.scrollX, y: r.top + window.scrollY};
  };
  var out = {errors: window.__probe, figures: [], titles: [], height: document.documentElement.scrollHeight};
  document.querySelectorAll("figure").forEach(function (f) {
    var svg = f.querySelector("svg");
    out.figures.push(Object.assign({cls: f.className, id: f.id, svg: !!svg}, box(svg || f)));
  });
  document.querySelectorAll(".finding").forEach(function (f) {
    out.titles.push(Object.assign({code: f.dataset.code, text: f.querySelector(".title").textContent},
                                  box(f.querySelector(".title"))));
  });
  var pre = document.createElement("pre");
  pre.id = "ddp-doctor-probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""

WIDTH = 1200
SCALE = 2
"""Device pixels per CSS pixel in screenshots: crisp enough for the README."""


@dataclass
class Rendered:
    probe: dict[str, Any]
    console: list[str]
    screenshot: Path

    def figures(self, cls: str) -> list[dict[str, Any]]:
        return [f for f in self.probe["figures"] if cls in f["cls"].split()]


def _browser() -> list[str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("Chromium is not installed: `apt-get install chromium` (make test and .ci/run install it).")
    # Every host name fails to resolve: a page that tried to fetch anything would log an error.
    return [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--enable-logging=stderr",
        "--v=0",
    ]


def render(page: Path, out: Path) -> Rendered:
    """Open `page` in headless Chromium; return the probe's findings, console messages and a full-page screenshot."""
    text = page.read_text()
    probed = out / f"{page.stem}.probed.html"
    probed.write_text(text.replace("<head>", "<head>" + _PROBE, 1))
    done = subprocess.run(
        [*_browser(), f"--window-size={WIDTH},1000", "--virtual-time-budget=10000", "--dump-dom", probed.as_uri()],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    found = re.search(r'<pre id="ddp-doctor-probe">(.*?)</pre>', done.stdout, re.DOTALL)
    assert found, f"the probe did not run: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    probe = json.loads(html.unescape(found.group(1)))
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    shot = out / f"{page.stem}.png"
    subprocess.run(
        [
            *_browser(),
            f"--window-size={WIDTH},{int(probe['height']) + 20}",
            f"--screenshot={shot}",
            f"--force-device-scale-factor={SCALE}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=180,
        check=True,
    )
    return Rendered(probe=probe, console=console, screenshot=shot)


def crop(shot: Path, box: dict[str, Any], dest: Path) -> Path:
    """Cut one element (a probe box, in CSS pixels) out of a screenshot taken at `SCALE`."""
    from PIL import Image

    image = Image.open(shot)
    left, top = max(int(box["x"] * SCALE), 0), max(int(box["y"] * SCALE), 0)
    right = min(int((box["x"] + box["w"]) * SCALE), image.width)
    bottom = min(int((box["y"] + box["h"]) * SCALE), image.height)
    image.crop((left, top, right, bottom)).save(dest)
    return dest


def not_blank(png: Path) -> bool:
    """More than a flat image: real contrast and many grey levels."""
    from PIL import Image

    pixels = Image.open(png).convert("L")
    low, high = pixels.getextrema()
    return high - low > 100 and sum(1 for count in pixels.histogram() if count) > 20
