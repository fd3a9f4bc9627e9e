"""report.html and index.html in a real headless browser (Debian's chromium): the inline plots must
render. Skips where chromium is not installed (CI installs it: apt-get install -y chromium)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvchaos.harness.judge.runner import run_scenario
from kvchaos.harness.judge.scenario import load_scenario
from kvchaos.harness.report.render import publish

CHROMIUM = next(
    (p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and Path(p).is_file()),
    None,
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium at /usr/bin/chromium or on PATH: "
    "install it with `apt-get install -y chromium` to run the browser tests",
)
# colours only the figure draws: tab:blue (latency and request lines), tab:green (free blocks),
# tab:red (diverged)
BLUE, GREEN, RED = (31, 119, 180), (44, 160, 44), (214, 39, 40)


def screenshot(page: Path, tmp: Path, height: int = 2400) -> np.ndarray:
    import matplotlib.image

    png = tmp / f"{page.stem}.png"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp / 'profile'}",
        f"--screenshot={png}",
        f"--window-size=1200,{height}",
        page.resolve().as_uri(),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.is_file() and png.stat().st_size > 10_000, (
        f"no screenshot: {out.returncode} {out.stderr[-2000:]}"
    )
    img = matplotlib.image.imread(png)[..., :3]
    assert img.shape[:2] == (height, 1200)
    return img


def colour_pixels(img: np.ndarray, rgb: tuple[int, int, int], tol: int = 12) -> int:
    return int((np.abs(img * 255 - np.array(rgb)).max(axis=-1) <= tol).sum())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("reports")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCHAOS_PLOTS", "incidents")  # the race is caught (PASS): draw its figure too
        return d, [
            publish(run_scenario(load_scenario(n), 0, device="cpu", report_dir=d))
            for n in ("ordering-race-detect", "baseline-clean")
        ]


def test_report_with_incident_renders_its_plots(runs, tmp_path):
    _, (race, _) = runs
    img = screenshot(race.run_dir / "report.html", tmp_path)
    assert img.std() > 0.05  # not a blank page
    for rgb, least in (
        (BLUE, 500),
        (GREEN, 300),
        (RED, 1000),
    ):  # the race diverges: red request lines
        assert colour_pixels(img, rgb) > least, f"the figure's {rgb} lines are not on the page"


def test_clean_report_and_index_render(runs, tmp_path):
    d, (_, clean) = runs
    img = screenshot(clean.run_dir / "report.html", tmp_path, 1200)
    assert img.std() > 0.05
    assert (
        colour_pixels(img, GREEN) < 50
    )  # no figure for a clean run: the colour check discriminates
    index = screenshot(d / "index.html", tmp_path, 800)
    assert (
        index.std() > 0.05 and colour_pixels(index, (42, 125, 42), tol=6) > 200
    )  # the green PASS badges
