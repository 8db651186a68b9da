"""The docs site builds strict (warnings are errors: a broken link, a missing anchor or a
page left out of the navigation fails it), and a built page renders in a real Chromium.

The build is Sphinx with MyST and Furo, the `docs` extra (part of `test`), run as
`make docs` runs it, into a temporary directory. The page is served on 127.0.0.1 by a
plain HTTP server and opened in Debian's headless chromium driven by selenium; without
chromium this skips on a developer's machine and fails under CI (CI=true).
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.helpers import require

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 180
#: The flags of `make docs`: warnings are errors, all of them reported, nitpicky.
STRICT = ["-W", "--keep-going", "-n", "-q", "-b", "html"]


def build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    try:
        import sphinx  # noqa: F401
    except ImportError:
        require("sphinx", False, "pip install -e '.[docs]'")
    return subprocess.run(
        [sys.executable, "-m", "sphinx", *STRICT, str(source), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs-site")
    result = build(DOCS, out)
    assert result.returncode == 0, f"the docs site does not build strict:\n{result.stderr}"
    return out


def test_the_site_builds_strict_with_a_page_per_area(site: Path) -> None:
    pages = {path.stem for path in DOCS.glob("*.md")}
    for area in (
        "index",
        "configuration",
        "lanes-and-tenants",
        "models",
        "clusters",
        "operating",
        "diagnosing",
        "benchmarks",
        "matrix",
        "simulator",
        "api",
        "development",
    ):
        assert area in pages
        assert (site / f"{area}.html").is_file(), area
    # Links to the repository's own files (config, manifests) are checked and shipped.
    assert any((site / "_downloads").rglob("gateway.toml"))


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The strict build is what catches a broken link: the same sources with one added fail."""
    source = tmp_path / "docs"
    shutil.copytree(DOCS, source)
    # a copy outside the repository: its links to ../config/... cannot resolve either,
    # so the check is that the added ones are named
    with (source / "development.md").open("a") as page:
        page.write("\n[a page that is not there](no-such-page.md)\n")
        page.write("\n[a heading that is not there](models.md#no-such-heading)\n")
    result = build(source, tmp_path / "out")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr
    assert "no-such-heading" in result.stderr


# --- one page in Chromium --------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def browser(request: pytest.FixtureRequest) -> WebDriver:
    chromium = shutil.which("chromium")
    chromedriver = shutil.which("chromedriver")
    install = "Debian: apt-get install chromium chromium-driver; .ci/run does it"
    require("`chromium`", chromium is not None, install)
    require("`chromedriver`", chromedriver is not None, install)
    assert chromium is not None and chromedriver is not None
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    # A desktop width: on a narrow window the theme folds the navigation away.
    options.add_argument("--window-size=1280,900")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    request.addfinalizer(driver.quit)
    driver.set_page_load_timeout(20)
    driver.set_script_timeout(20)
    return driver


def test_a_page_renders_in_chromium_with_its_heading_and_the_navigation(
    browser: WebDriver, served: str
) -> None:
    browser.get(f"{served}/configuration.html")
    WebDriverWait(browser, 10).until(lambda b: b.find_elements(By.CSS_SELECTOR, "article h1"))
    heading = browser.find_element(By.CSS_SELECTOR, "article h1").text
    assert heading.rstrip("#¶ \n") == "Configuration"
    assert browser.title.startswith("Configuration")
    assert "LLM tail-latency gateway" in browser.title
    # The sidebar lists the other areas; following one lands on its page.
    sidebar = browser.find_element(By.CSS_SELECTOR, ".sidebar-tree")
    link = sidebar.find_element(By.LINK_TEXT, "Lanes and tenants")
    browser.get(link.get_attribute("href") or "")
    WebDriverWait(browser, 10).until(lambda b: b.find_elements(By.CSS_SELECTOR, "article h1"))
    heading = browser.find_element(By.CSS_SELECTOR, "article h1").text
    assert heading.rstrip("#¶ \n") == "Lanes and tenants"
