"""The playground page at ``GET /``: one static file with no external resources, the recipe list it reads,
and (slow) a headless Chromium that fills the form, clicks and sees the streamed answer with its KV bytes."""

from __future__ import annotations

import re
import shutil
import tempfile

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from test_serve import CTX, MODEL, Server  # noqa: E402  (the loopback server helper of tests/test_serve.py)

from longlab.serve import create_app  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def server():
    from longlab.models import build_tiny_model, tiny_tokenizer

    srv = Server(create_app(build_tiny_model(MODEL), tiny_tokenizer(), model_name=MODEL,
                            default_recipe="snapkv@0.5"))
    yield srv
    srv.close()


def test_the_page_is_one_static_file_with_nothing_external(server):
    page = server.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    for id_ in ("context", "question", "recipe", "ask", "answer", "stat-kv", "stat-ttft"):
        assert f'id="{id_}"' in html
    # no CDN, no external fonts or scripts: every src/href/url()/import is relative or absent
    refs = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']+)|url\(([^)]+)\)|@import\s+["\']?([^"\';]+)', html)
    assert not [r for group in refs for r in group if r and not r.startswith(("/", "#"))]
    assert "//" not in "".join(re.findall(r'fetch\(([^)]*)\)', html)).replace('"/', "")


def test_recipes_lists_registered_methods_default_first(server):
    from longlab.recipe import parse_recipe

    body = server.get("/v1/recipes").json()
    examples = [r["example"] for r in body["data"]]
    assert body["default"] == "snapkv@0.5" and examples[0] == "snapkv@0.5"
    assert {"full", "streaming@0.5", "kivi4", "quest"} <= set(examples)
    assert len(examples) == len(set(examples))
    for example in examples:
        parse_recipe(example)  # every entry is a recipe a request may send


def _driver(profile: str):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            pytest.skip(f"{path} is absent (Debian: apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.mark.slow
def test_headless_chromium_sees_a_streamed_answer(server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    with tempfile.TemporaryDirectory(prefix="longlab-chromium-") as profile:
        driver = _driver(profile)
        try:
            driver.get(server.url + "/")
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: d.find_element(By.ID, "model").text == MODEL)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#recipe option")) > 5)
            driver.find_element(By.ID, "context").send_keys(CTX)
            driver.find_element(By.ID, "question").send_keys("Where is item 3?")
            Select(driver.find_element(By.ID, "recipe")).select_by_value("streaming@0.5")
            count = driver.find_element(By.ID, "max-tokens")
            count.clear()
            count.send_keys("12")
            driver.find_element(By.ID, "ask").click()
            wait.until(lambda d: d.find_element(By.ID, "status").text in ("done", "failed"))
            assert driver.find_element(By.ID, "error").text == ""
            answer = driver.find_element(By.ID, "answer").text
            assert driver.find_element(By.ID, "status").text == "done" and answer.strip()
            assert int(driver.find_element(By.ID, "answer").get_attribute("data-chunks")) >= 2  # streamed
            assert driver.find_element(By.ID, "stat-recipe").text.startswith("streaming")
            kv = driver.find_element(By.ID, "stat-kv").text
            assert re.fullmatch(r"[\d.]+ \w+ → [\d.]+ \w+", kv), kv
            assert driver.find_element(By.ID, "stat-ttft").text.endswith(" s")
            tokens = driver.find_element(By.ID, "stat-tokens").text
            assert re.fullmatch(r"\d+ / \d+", tokens) and int(tokens.split(" / ")[1]) >= 1
            same = server.client.chat.completions.create(  # the page's request, sent by the openai client
                model=MODEL, max_tokens=12, extra_body={"recipe": "streaming@0.5"},
                messages=[{"role": "user", "content": CTX + "\n\nQuestion: Where is item 3?"}])
            assert answer.strip() == same.choices[0].message.content.strip()
        finally:
            driver.quit()
