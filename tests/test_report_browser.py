"""``longlab report`` -> ``report.html`` opened in a real browser (headless Debian Chromium through selenium):
the plots load (``naturalWidth > 0``) and the score tables are there. Skipped where chromium, chromedriver or
selenium is absent."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import pytest

from longlab.eval.report import write_report
from longlab.eval.store import ResultStore

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("selenium") is None, reason="selenium not installed"),
    pytest.mark.skipif(not (Path(CHROMIUM).is_file() and Path(DRIVER).is_file()),
                       reason="chromium / chromedriver not installed"),
]


def _rows() -> list[dict]:
    """A small grid: full and two KV recipes at two lengths and five needle depths (scores fall with the
    ratio and the depth, so every plot has data)."""
    rows = []
    for recipe, ratio in (("full", 0.0), ("snapkv@0.5", 0.5), ("streaming@0.75", 0.75)):
        for length in (1024, 2048):
            for i, depth in enumerate((0.0, 0.25, 0.5, 0.75, 1.0)):
                kv = 73728 * length
                rows.append({
                    "model": "m", "recipe": recipe, "method": recipe.split("@")[0],
                    "compression_ratio": ratio, "task": "niah", "length": length,
                    "sample_id": f"niah-{length}-{i}", "depth": depth,
                    "score": float(depth * ratio < 0.4), "kv_bytes_before": kv,
                    "kv_bytes_after": int(kv * (1 - ratio)),
                })
    return rows


def _driver():  # noqa: ANN202 (selenium's WebDriver)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="longlab-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(DRIVER), options=opts), profile


def test_report_html_renders_plots_and_tables(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    with ResultStore(tmp_path) as store:
        store.add_many(_rows())
    paths = write_report(tmp_path)
    assert {"html", "score_vs_ratio", "pareto", "depth_length_heatmap"} <= set(paths)
    driver, profile = _driver()
    try:
        driver.set_page_load_timeout(60)
        driver.get(paths["html"].resolve().as_uri())
        assert driver.title == "longlab report"
        images = driver.find_elements(By.TAG_NAME, "img")
        assert len(images) == 3
        for img in images:
            loaded = driver.execute_script(
                "return arguments[0].complete ? arguments[0].naturalWidth : 0", img,
            )
            assert loaded > 100, img.get_attribute("src")  # a broken image has naturalWidth 0
        tables = driver.find_elements(By.TAG_NAME, "table")
        assert tables, "no table rendered"
        text = driver.find_element(By.TAG_NAME, "body").text
        for recipe in ("full", "snapkv@0.5", "streaming@0.75"):
            assert recipe in text
        headers = [th.text for th in tables[0].find_elements(By.TAG_NAME, "th")]
        assert headers and headers[0] == "recipe", headers
        # a missing plot is detected: the same check on a page whose image file is gone
        paths["pareto"].unlink()
        driver.get(paths["html"].resolve().as_uri())
        widths = driver.execute_script(
            "return Array.from(document.images).map(i => i.complete ? i.naturalWidth : -1)"
        )
        assert sorted(w > 0 for w in widths) == [False, True, True]
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
