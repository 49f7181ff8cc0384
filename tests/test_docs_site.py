"""The documentation site: code blocks fit the page, and the built site works offline in chromium.

The browser tests build the site with ``mkdocs build --strict`` into a temporary directory
(never ``site/``, which ``make docs-build`` writes), serve it from a thread on 127.0.0.1, and
drive the system's chromium through Playwright, visiting every page once in a module-scoped
fixture. They are skipped, saying why, when Playwright or chromium is missing
(``LUCID_REPLAY_CHROMIUM`` points at another chromium binary).
"""

from __future__ import annotations

import ast
import functools
import http.server
import inspect
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lucid_replay

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CHROMIUM = Path(os.environ.get("LUCID_REPLAY_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Material's content column shows 80 monospace characters at a 1280-pixel window; docs/.ruff.toml
# formats the Python blocks of docs/ at the same width.
CODE_COLUMNS = 80
VIEWPORT = {"width": 1280, "height": 900}
TIMEOUT_MS = 15_000
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
FENCE = re.compile(r"^\s*(```|~~~)")

# Everything the tests check is gathered by one visit of every page (see `visited`).
_OVERFLOW_JS = """() => [...document.querySelectorAll('pre > code')]
  .filter(code => code.scrollWidth > code.clientWidth)
  .map(code => ({width: code.scrollWidth, room: code.clientWidth,
                 longest: Math.max(...code.innerText.split('\\n').map(line => line.length))}))"""
_MATH_JS = """async () => {
  await document.fonts.ready;
  const math = [...document.querySelectorAll('.arithmatex')];
  const fonts = [...document.fonts].filter(font => font.family.includes('KaTeX'));
  return {formulas: math.length,
          typeset: math.filter(node => node.querySelector('.katex')).length,
          fonts_loaded: fonts.filter(font => font.status === 'loaded').length,
          fonts_failed: fonts.filter(font => font.status === 'error').map(font => font.family)};
}"""


def _fenced_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line inside a fenced code block of a markdown text."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
        elif inside:
            yield number, line


def _doctest_lines(source: str) -> Iterator[tuple[int, str]]:
    """(docstring line, line) of every line of an example in the docstrings of a module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=True)
            inside = False
            for number, line in enumerate((docstring or "").splitlines(), 1):
                inside = line.startswith(">>>") or (inside and bool(line.strip()))
                if inside:
                    yield number, line


def test_docs_code_blocks_fit_the_content_column():
    """No line of a fenced code block under docs/ is wider than the page's code column."""
    wide = [
        f"{page.relative_to(ROOT)}:{number}: {len(line)} columns: {line.strip()}"
        for page in sorted(DOCS.rglob("*.md"))
        for number, line in _fenced_lines(page.read_text(encoding="utf-8"))
        if len(line) > CODE_COLUMNS
    ]
    assert not wide, "\n".join(wide)


def test_docstring_examples_fit_the_content_column():
    """No docstring example line (rendered on the API reference pages) exceeds the code column."""
    wide = [
        f"{module.relative_to(ROOT)}, docstring line {number}: {len(line)} columns: {line}"
        for module in sorted((ROOT / "lucid_replay").rglob("*.py"))
        for number, line in _doctest_lines(module.read_text(encoding="utf-8"))
        if len(line) > CODE_COLUMNS
    ]
    assert not wide, "\n".join(wide)


def _is_property(node: ast.FunctionDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "property")
        or (isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter"))
        for d in node.decorator_list
    )


def _methods_in_source_order(cls: type) -> list[str]:
    """Public methods (not properties) the class body defines, in the order it defines them.

    mkdocstrings lists properties (attributes) before methods; within each group the order is
    the source's.
    """
    body = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(body, ast.ClassDef)
    return [
        node.name
        for node in body.body
        if isinstance(node, ast.FunctionDef)
        and not node.name.startswith("_")
        and not _is_property(node)
    ]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def visited(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Build the site, serve it on 127.0.0.1, open every page in chromium; what was seen."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as error:
        pytest.skip(f"playwright is not installed ({error}); it comes with the 'dev' extra")
    if not CHROMIUM.is_file():
        pytest.skip(
            f"chromium not found at {CHROMIUM} (Debian: apt-get install chromium, or set "
            "LUCID_REPLAY_CHROMIUM); the docs site is only checked in a browser where one is"
        )
    site = tmp_path_factory.mktemp("docs-site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site))
    )
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    pages = sorted(
        "" if path.parent == site else f"{path.parent.relative_to(site).as_posix()}/"
        for path in site.rglob("index.html")
    )
    seen: dict[str, Any] = {"base": base, "pages": pages, "requests": [], "errors": []}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000
            )
            try:
                _visit(browser, seen)
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    return seen


def _visit(browser: Any, seen: dict[str, Any]) -> None:
    """Open every page of the site once and record what the tests check."""
    base = seen["base"]
    context = browser.new_context(viewport=VIEWPORT, service_workers="block")
    context.set_default_timeout(TIMEOUT_MS)
    context.on("request", lambda request: seen["requests"].append(request.url))

    def keep_local(route: Any) -> None:
        # Never wait on the network: a request to another host is recorded above and refused.
        url = urllib.parse.urlsplit(route.request.url)
        if url.scheme in ("http", "https") and url.hostname not in LOCAL_HOSTS:
            route.abort()
        else:
            route.continue_()

    context.route("**/*", keep_local)
    page = context.new_page()
    page.on("pageerror", lambda error: seen["errors"].append(f"{page.url}: {error}"))
    seen["overflow"] = {}
    for path in seen["pages"]:
        page.goto(base + path, wait_until="load")
        page.evaluate("document.fonts.ready.then(() => true)")
        seen["overflow"][path] = page.evaluate(_OVERFLOW_JS)
        if path in _CHECKS:
            key, check = _CHECKS[path]
            try:
                seen[key] = check(page)
            except Exception as error:  # recorded, so that only the test that needs it fails
                seen[key] = _Failed(f"{base}{path}: {error}")
    try:
        seen["search"] = _search(page, base)
    except Exception as error:
        seen["search"] = _Failed(f"search: {error}")
    context.close()


class _Failed:
    """A check that raised while the pages were visited; its test fails with the message."""

    def __init__(self, message: str) -> None:
        self.message = message


def _seen(visited: dict[str, Any], key: str) -> Any:
    value = visited[key]
    if isinstance(value, _Failed):
        pytest.fail(value.message)
    return value


def _home(page: Any) -> dict[str, Any]:
    return {
        "title": page.title(),
        "h1": page.locator("article h1").first.inner_text().removesuffix("¶").strip(),
        "repo": page.locator("a.md-source").first.get_attribute("href"),
    }


def _math(page: Any) -> dict[str, Any]:
    page.wait_for_selector(".arithmatex .katex")
    return {**page.evaluate(_MATH_JS), "text": page.locator("article").inner_text()}


def _reference(page: Any) -> list[str]:
    return page.evaluate(
        "() => [...document.querySelectorAll('[id^=\"lucid_replay.\"]')]"
        ".filter(node => /^H[1-6]$/.test(node.tagName)).map(node => node.id)"
    )


def _search(page: Any, base: str) -> list[str]:
    """The links Material's search box lists for a query typed key by key (it reads keyup)."""
    page.goto(base, wait_until="load")
    search = page.locator("input.md-search__input")
    search.click()
    search.press_sequentially("checkpoint")
    results = page.locator(".md-search-result__item a")
    results.first.wait_for(state="attached")
    return [results.nth(i).get_attribute("href") for i in range(results.count())]


_CHECKS = {
    "": ("home", _home),
    "concepts/priorities/": ("math", _math),
    "reference/buffers/": ("reference", _reference),
}


def test_home_page_renders(visited):
    """The home page has the project's title and heading and links the repository."""
    home = _seen(visited, "home")
    assert home["title"].startswith("lucid_replay")
    assert home["h1"] == "lucid_replay"
    assert home["repo"] == "https://github.com/lucid-replay/lucid_replay"


def test_formulas_are_typeset_by_katex_with_its_own_fonts(visited):
    """Every formula of the priorities page is typeset by KaTeX, whose fonts the site serves."""
    math = _seen(visited, "math")
    assert math["formulas"] > 0
    assert math["typeset"] == math["formulas"]
    assert math["fonts_loaded"] > 0, "no KaTeX font loaded"
    assert not math["fonts_failed"], math["fonts_failed"]
    for raw in ("\\frac", "\\alpha", "$$"):
        assert raw not in math["text"], f"raw TeX {raw!r} is visible"


def test_api_reference_lists_members_in_source_order(visited):
    """The buffers page documents both buffers, each with its methods in source order."""
    headings = _seen(visited, "reference")
    for cls in (lucid_replay.SequenceReplay, lucid_replay.PrioritizedSequenceReplay):
        assert f"lucid_replay.{cls.__name__}" in headings
        prefix = f"lucid_replay.{cls.__name__}."
        shown = [h[len(prefix) :] for h in headings if h.startswith(prefix)]
        expected = _methods_in_source_order(cls)
        assert len(expected) > 3
        assert [name for name in shown if name in expected] == expected


def test_search_finds_a_page(visited):
    """Typing in Material's search box lists results that are pages of this site."""
    links = _seen(visited, "search")
    assert links, "no search result for 'checkpoint'"
    assert all(link.startswith(visited["base"]) for link in links), links
    assert any("checkpoint" in link for link in links), links


def test_no_code_block_scrolls_sideways(visited):
    """At a 1280-pixel window no `pre > code` on any page is wider than its box."""
    wide = {page: blocks for page, blocks in visited["overflow"].items() if blocks}
    assert len(visited["overflow"]) == len(visited["pages"]) > 10
    assert not wide, wide


def test_pages_load_nothing_from_other_hosts_and_raise_no_errors(visited):
    """Every request goes to the local server (KaTeX included) and no page throws."""
    hosts = {urllib.parse.urlsplit(url).hostname for url in visited["requests"]}
    schemes = {urllib.parse.urlsplit(url).scheme for url in visited["requests"]}
    foreign = [url for url in visited["requests"] if url.startswith(("http:", "https:"))]
    foreign = [url for url in foreign if urllib.parse.urlsplit(url).hostname not in LOCAL_HOSTS]
    assert not foreign, foreign
    assert hosts & LOCAL_HOSTS and schemes <= {"http", "data", "blob"}, (hosts, schemes)
    assert any(url.endswith("assets/katex/katex.min.js") for url in visited["requests"])
    assert not visited["errors"], visited["errors"]
