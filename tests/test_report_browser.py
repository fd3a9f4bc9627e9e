"""report.html and index.html in a real headless browser (Debian's chromium): the figure of a
caught detection must render. Without chromium these skip locally and FAIL in CI (CI=true): .ci/run
installs it (apt-get install -y chromium). The figure's content and embedding are checked without
a browser too."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvchaos.harness.report import render
from kvchaos.harness.report.render import publish
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario

CHROMIUM = next(
    (p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and Path(p).is_file()),
    None,
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# colours only the figure draws: tab:blue (latency and request lines), tab:green (free blocks),
# tab:red (diverged), tab:orange (requests an incident names)
BLUE, GREEN, RED, ORANGE = (31, 119, 180), (44, 160, 44), (214, 39, 40), (255, 127, 14)
FIGURE = re.compile(r'<img class="plot" alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def browser() -> str:
    """The browser, or a skip with the reason; in CI a missing browser fails the test instead:
    a screenshot test that quietly skips there checks nothing. Called in the test, not a fixture,
    so that CI reports a failed test, not a fixture error."""
    if CHROMIUM is None:
        why = "no chromium at /usr/bin/chromium or on PATH (apt-get install -y chromium)"
        if IN_CI:
            pytest.fail(f"CI=true and {why}: the report's figure cannot be checked", pytrace=False)
        pytest.skip(why)
    return CHROMIUM


def screenshot(browser: str, page: Path, tmp: Path, height: int = 2400) -> np.ndarray:
    import matplotlib.image

    png = tmp / f"{page.stem}.png"
    cmd = [
        browser,
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
        f"--window-size=1400,{height}",
        page.resolve().as_uri(),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.is_file() and png.stat().st_size > 10_000, (
        f"the browser could not start or draw: {out.returncode} {out.stderr[-2000:]}"
    )
    img = matplotlib.image.imread(png)[..., :3]
    assert img.shape[:2] == (height, 1400)
    return img


def colour_pixels(img: np.ndarray, rgb: tuple[int, int, int], tol: int = 12) -> int:
    return int((np.abs(img * 255 - np.array(rgb)).max(axis=-1) <= tol).sum())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("reports")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(render.PLOTS_ENV, raising=False)  # the default: caught detections get a figure
        return d, [
            publish(run_scenario(load_scenario(n), 0, device="cpu", report_dir=d))
            for n in ("ordering-race-detect", "refcount-leak-detect", "baseline-clean")
        ]


def test_a_caught_detection_report_shows_its_figure(runs, tmp_path):
    chromium = browser()
    _, (race, _, _) = runs
    assert race.verdict == "PASS" and race.results["incidents"]  # caught: a PASS with a finding
    img = screenshot(chromium, race.run_dir / "report.html", tmp_path)
    assert img.std() > 0.05  # not a blank page
    # the race diverges (red request lines) and names every request it touched (orange)
    for rgb, least in ((BLUE, 150), (GREEN, 300), (RED, 1000), (ORANGE, 300)):
        assert colour_pixels(img, rgb) > least, f"the figure's {rgb} lines are not on the page"


def test_the_figure_is_embedded_in_the_html(runs):
    """No browser needed: the figure is a PNG inside report.html, no file beside it to lose."""
    import matplotlib.image

    _, (race, leak, clean) = runs
    for r in (race, leak):
        html = (r.run_dir / "report.html").read_text()
        (data,) = FIGURE.findall(html)
        png = base64.b64decode(data)
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        img = matplotlib.image.imread(io.BytesIO(png))
        assert img.shape[1] >= 1000 and img[..., :3].std() > 0.05
        assert not re.search(r'(src|href)="(https?:)?//', html)  # self-contained
    assert not FIGURE.findall((clean.run_dir / "report.html").read_text())  # nothing to draw


def test_the_figure_marks_detection_fault_window_and_affected_requests(runs):
    from kvchaos.harness.report.plots import draw
    from kvchaos.harness.report.view import RunView

    _, (_, r, _) = runs
    (inc,) = r.results["incidents"]
    fig = draw(RunView(r.events), r.results["fault_verify"], [inc])
    ax_lat, ax_free, ax_div = fig.axes
    labels = ax_lat.get_legend_handles_labels()[1]
    det, fired = inc["detection"]["first_step"], inc["detection"]["fault_first_step"]
    assert f"detected by block_accounting (step {det})" in labels
    assert f"refcount_leak fired (step {fired})" in labels
    assert "refcount_leak window (triggered or fired)" in labels
    assert all("latency_s" not in x for x in labels) and "ms" in ax_lat.get_ylabel()
    assert any(x.endswith("(ms)") for x in labels)  # the legend's unit is the axis's
    # the affected requests are drawn (and named) in orange, the leaks marked where found
    orange = {t.get_text() for t in ax_div.get_yticklabels() if t.get_color() == "tab:orange"}
    assert orange == {a["req"] for a in inc["impact"]["requests_affected"]} != set()
    assert "leak found" in ax_div.get_legend_handles_labels()[1]
    leaked = inc["impact"]["blocks_leaked"]["count"]
    assert f"pool less the {leaked} leaked blocks" in ax_free.get_legend_handles_labels()[1]


def test_clean_report_and_index_render(runs, tmp_path):
    chromium = browser()
    d, (_, _, clean) = runs
    img = screenshot(chromium, clean.run_dir / "report.html", tmp_path, 1200)
    assert img.std() > 0.05
    # no figure for a clean run: the colour check discriminates
    assert colour_pixels(img, GREEN) < 50
    index = screenshot(chromium, d / "index.html", tmp_path, 800)
    # the green PASS badges
    assert index.std() > 0.05 and colour_pixels(index, (42, 125, 42), tol=6) > 200


def test_the_index_filters_run_in_the_browser(runs, tmp_path):
    """The inline script filters by verdict, scenario and fault (read from the address here)."""
    chromium = browser()
    d, (race, leak, clean) = runs
    url = (d / "index.html").resolve().as_uri() + "#verdict=PASS&fault=ordering_race"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", url]
    cmd.insert(1, f"--user-data-dir={tmp_path / 'profile'}")
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    rows = dict(
        re.findall(r'<tr class="run" data-verdict="\w+" data-scenario="([^"]+)"([^>]*)>', dom)
    )
    assert set(rows) == {race.scenario, leak.scenario, clean.scenario}, dom[-2000:]
    assert "hidden" not in rows[race.scenario]
    assert "hidden" in rows[leak.scenario] and "hidden" in rows[clean.scenario]
    assert '<span id="f-count">1</span>' in dom


def probe(browser: str, page: Path, script: str, tmp: Path, width: int = 1400) -> dict:
    """Run `script` (JavaScript that sets `out`) on `page` laid out in a window `width` px wide;
    `out` comes back as JSON. The page is copied beside itself, so its links resolve alike."""
    import json

    copy = page.with_name(f"probe-{page.name}")
    tag = "<script>var out = {};\n" + script
    tag += '\nvar p = document.createElement("pre"); p.id = "probe";'
    tag += "\np.textContent = JSON.stringify(out); document.body.appendChild(p);</script>"
    copy.write_text(page.read_text().replace("</body>", tag + "</body>"))
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"]
    cmd += [f"--user-data-dir={tmp / 'profile'}", f"--window-size={width},900", copy.as_uri()]
    try:
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    finally:
        copy.unlink()
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def contrast(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """WCAG 2 contrast ratio of two sRGB colours (0..255)."""

    def lum(c):
        lin = [x / 255 / 12.92 if x <= 10.31 else ((x / 255 + 0.055) / 1.055) ** 2.4 for x in c]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((lum(a[:3]), lum(b[:3])), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _hex(h: str) -> tuple[int, int, int]:
    h = h[1:] if len(h) == 7 else "".join(c * 2 for c in h[1:])  # #fff is #ffffff
    return tuple(int(h[i : i + 2], 16) for i in (0, 2, 4))


def test_every_badge_class_has_a_readable_background(runs):
    """No browser needed: each verdict or severity a badge shows has its own background, one
    white text reads on (the CAUGHT badge was white on white)."""
    d, (race, leak, clean) = runs
    for page in (race.run_dir / "report.html", leak.run_dir / "report.html", d / "index.html"):
        html = page.read_text()
        css = " ".join(re.findall(r"<style>(.*?)</style>", html, re.S))
        fg = re.search(r"\.v \{[^}]*?color: (#[0-9a-f]{3}(?:[0-9a-f]{3})?);", css).group(1)
        bg = {}
        for names, colour in re.findall(
            r"((?:\.[A-Z0-9_]+[, ]*)+)\{ background: (#[0-9a-f]{6});", css
        ):
            bg.update({n: colour for n in re.findall(r"\.([A-Z0-9_]+)", names)})
        used = set(re.findall(r'class="v (\w+)"', html))
        assert "CAUGHT" in used or page != race.run_dir / "report.html"
        for name in used:
            assert name in bg, f"{page.name}: badge {name} has no background: {fg} on the page"
            assert contrast(_hex(fg), _hex(bg[name])) >= 4.5, (page.name, name, bg[name])


def test_badges_read_in_the_browser(runs, tmp_path):
    chromium = browser()
    _, (race, _, _) = runs
    got = probe(
        chromium,
        race.run_dir / "report.html",
        'out.badges = Array.from(document.querySelectorAll(".v")).map(function (e) {\n'
        "  var s = getComputedStyle(e); return [e.textContent, s.color, s.backgroundColor]; });",
        tmp_path,
    )
    rgb = lambda s: tuple(float(x) for x in re.findall(r"[\d.]+", s))  # noqa: E731
    assert any(text == "CAUGHT" for text, _, _ in got["badges"]), got
    for text, fg, bg in got["badges"]:
        assert len(rgb(bg)) == 3 or rgb(bg)[3] > 0, f"{text}: no background ({bg})"
        assert contrast(rgb(fg), rgb(bg)) >= 4.5, (text, fg, bg)


def test_the_index_fits_a_1400_px_window_with_long_names(runs, tmp_path):
    """A manager named by its file's path, a long scenario name and a summary with a long path in
    it: the summary column stays in the window, nothing scrolls sideways."""
    import json

    from kvchaos.harness.report.index import update_index

    chromium = browser()
    d, runs_ = runs
    reports = tmp_path / "reports"
    for r in runs_:
        shutil.copytree(r.run_dir, reports / r.run_dir.name)
    res = reports / runs_[0].run_dir.name / "results.json"
    doc = json.loads(res.read_text())
    deep = "/home/someone/projects/my_engine/kv/block_managers/experimental_paged_manager_v2.py"
    doc["block_manager"] = f"{deep}:LeakyPagedBlockManagerWithPrefixReuse"
    doc["scenario"] = "a-very-long-scenario-name-from-a-user-project-detect-on-two-ranks"
    doc["summary"] += f" raised at {deep}:123 in admit_with_prefix_reuse_and_eviction"
    res.write_text(json.dumps(doc))
    update_index(reports)
    got = probe(
        chromium,
        reports / "index.html",
        "var d = document.documentElement; out.inner = innerWidth; out.scroll = d.scrollWidth;\n"
        'out.sums = Array.from(document.querySelectorAll("td.sum")).map(function (td) {\n'
        "  return td.getBoundingClientRect().right; });",
        tmp_path,
    )
    assert len(got["sums"]) == 3 and got["scroll"] <= got["inner"] == 1400, got
    assert max(got["sums"]) <= got["inner"], got
