"""The static course site: built once per session by tools/build_site.py, checked in Chromium.

Checks that can fail for real: every lesson in notebooks/ has a page and an index entry with
its Goals; every page loads in Chromium with no console error, no failed request and no
request leaving 127.0.0.1 (widget JS, require.js and MathJax are served by the site); every
lesson shows its figures (each <img> decoded with a non-zero size, markdown figures
included); every saved widget is rendered from its state, with the "needs a live kernel"
note on the page.
"""
from __future__ import annotations

import functools
import html
import http.server
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "browser"))
from course_browser import ARTIFACTS, chromium_context, under_ci

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
BUILD_TIMEOUT_S = 1200
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _tell(config, line: str) -> None:
    """Print past pytest's output capture (a session fixture has no capsys)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)


@pytest.fixture(scope="session")
def site(tmp_path_factory, request) -> Path:
    """Build the site once per session into a temp dir (``make site`` builds into site/)."""
    if shutil.which("npm") is None:
        msg = "npm is needed to fetch the site's widget JS (apt-get install npm)"
        pytest.fail(msg) if under_ci() else pytest.skip(msg)
    out = tmp_path_factory.mktemp("site")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "build_site.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=REPO)
    log = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        pytest.fail(f"tools/build_site.py exited {proc.returncode}:\n{log[-4000:]}", pytrace=False)
    _tell(request.config, f"\n[site] built {len(NOTEBOOKS)} lessons in {time.monotonic() - t0:.1f} s")
    for line in proc.stdout.splitlines():
        if line.startswith("executed"):
            _tell(request.config, f"[site]   {line}")
    return out


@pytest.fixture(scope="module")
def site_url(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")  # Playwright's driver holds an asyncio loop: stop it with this module
def site_browser(tmp_path_factory):
    with chromium_context(tmp_path_factory.mktemp("site-chromium")) as context:
        yield context


def _first_heading(nb_path: Path) -> str:
    nb = nbformat.read(nb_path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return nb_path.stem


def test_notebooks_exist():
    assert NOTEBOOKS, "notebooks/ holds no lesson: nothing to publish"


def test_index_lists_every_lesson_with_goals(site):
    index = (site / "index.html").read_text(encoding="utf-8")
    sections = dict(re.findall(r'<section class="lesson" data-notebook="([^"]+)">(.*?)</section>', index, re.S))
    assert list(sections) == [p.name for p in NOTEBOOKS], "index must list every lesson, in file order"
    for nb_path in NOTEBOOKS:
        body = sections[nb_path.name]
        page = f"notebooks/{nb_path.stem}.html"
        assert f'href="{page}"' in body and (site / page).is_file(), f"{nb_path.name}: no page {page}"
        assert html.escape(_first_heading(nb_path)) in body, f"{nb_path.name}: index title is not its # heading"
        goals = re.findall(r"<li>(.*?)</li>", re.search(r'<ul class="goals">(.*?)</ul>', body, re.S)[1], re.S)
        assert goals and "no Goals section" not in body, f"{nb_path.name}: no Goals parsed from the notebook"
    figures = REPO / "figures"
    if figures.is_dir():
        missing = [f.name for f in figures.iterdir() if f.is_file() and not (site / "figures" / f.name).is_file()]
        assert not missing, f"figures not copied into the site: {missing}"


# In the page: every <img> decoded (complete, non-zero natural size), and each saved widget view
# replaced by live widget DOM from the html-manager.
PAGE_STATE_JS = """() => ({
    images: [...document.images].map(i => ({src: i.src.slice(0, 80), ok: i.complete && i.naturalWidth > 0,
                                             w: i.naturalWidth, h: i.naturalHeight})),
    views: [...document.querySelectorAll('script[type="%s"]')].map(s =>
        !!s.parentElement.querySelector('.widget-subarea .lm-Widget, .widget-subarea .jupyter-widgets')),
    note: !!document.querySelector('.course-widget-note'),
    dbxCounts: (document.querySelector('.dbx-counts') || {}).innerText || null,
    frxFlops: (document.querySelector('.frx-flops') || {}).innerText || null,
})""".replace("%s", WIDGET_VIEW)


def _open(context, url: str):
    page = context.new_page()
    problems, origin = [], "{0.scheme}://{0.netloc}".format(urlparse(url))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url[:120]} ({r.failure})"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url[:120]}") if r.status >= 400 else None)
    page.on("request", lambda r: problems.append(f"non-local request: {r.url[:120]}")
            if r.url.startswith(("http:", "https:", "ws:", "wss:")) and not r.url.startswith(origin) else None)
    page.goto(url, wait_until="load")
    page.wait_for_load_state("networkidle")
    return page, problems


def test_index_page_renders(site, site_url, site_browser):
    page, problems = _open(site_browser, f"{site_url}/index.html")
    links = page.locator("section.lesson h2 a").count()
    page.close()
    assert not problems, "\n".join(problems)
    assert links == len(NOTEBOOKS)


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_lesson_page_renders(nb_path, site, site_url, site_browser):
    html_path = site / "notebooks" / f"{nb_path.stem}.html"
    source = html_path.read_text(encoding="utf-8")
    n_views = source.count(f'<script type="{WIDGET_VIEW}">')
    page, problems = _open(site_browser, f"{site_url}/notebooks/{html_path.name}")
    if n_views:  # the html-manager renders after load; give it a few seconds on 2 cores
        try:
            page.wait_for_function(
                f"""() => [...document.querySelectorAll('script[type="{WIDGET_VIEW}"]')].every(s =>
                    s.parentElement.querySelector('.widget-subarea .lm-Widget, .widget-subarea .jupyter-widgets'))""",
                timeout=30_000)
        except Exception:
            pass  # reported by the assertions below, with what did render
        page.wait_for_load_state("networkidle")
    state = page.evaluate(PAGE_STATE_JS)
    shots = ARTIFACTS / "site"
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / f"{nb_path.stem}.png"), full_page=True)
    page.close()

    assert not problems, f"{html_path.name}:\n" + "\n".join(problems)
    broken = [i for i in state["images"] if not i["ok"]]
    assert not broken, f"{html_path.name}: images that did not render: {broken}"
    assert state["images"], f"{nb_path.name} shows no figure on its page"
    md_figures = re.findall(r"(?:!\[[^\]]*\]\(|<img[^>]*src=[\"'])([^)\"'\s]+)",
                            "\n".join(c.source for c in nbformat.read(nb_path, as_version=4).cells
                                      if c.cell_type == "markdown"))
    for ref in md_figures:
        if ref.startswith(("attachment:", "data:")):
            continue  # embedded in the page, no file name to look for
        name = ref.split("/")[-1]
        assert any(name in i["src"] for i in state["images"]), f"{nb_path.name}: markdown figure {ref} not on the page"
    assert len(state["views"]) == n_views
    assert all(state["views"]), f"{html_path.name}: {state['views'].count(False)} of {n_views} saved widgets did not render"
    if n_views:
        assert state["note"], f"{html_path.name} has widgets but no 'needs a live kernel' note"
    if state["dbxCounts"] is not None:  # lesson 03's explorer, drawn from saved state
        assert re.search(r"varlen: computed \d+ \| useful \d+ \| wasted 0", state["dbxCounts"]), state["dbxCounts"]
    if state["frxFlops"] is not None:   # lesson 05's explorer
        assert re.fullmatch(r"linear \d+ \| attention \d+ \| dominant (linear|attention)", state["frxFlops"].strip())


# ---------------------------------------------------------------- build_site units (no browser)

sys.path.insert(0, str(REPO / "tools"))
import build_site  # noqa: E402


def _run(coro):
    """asyncio.run on a fresh thread: this thread may hold Playwright's loop."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def test_sliced_poll_waits_in_short_slices():
    """A channel wait of 60 s becomes polls of <= POLL_SLICE_S: a message that arrived while
    one poll missed its wake-up (nbclient#312) is picked up by the next one."""
    import queue
    clock = {"t": 0.0}
    now = lambda: clock["t"]
    asked = []

    async def get_msg(timeout=None):  # the message is there from t = 2 s on
        asked.append(timeout)
        clock["t"] += timeout
        if clock["t"] < 2.0:
            raise queue.Empty
        return {"msg": "reply"}

    assert _run(build_site._sliced(get_msg, now)(timeout=60)) == {"msg": "reply"}
    assert asked and max(asked) <= build_site.POLL_SLICE_S and clock["t"] <= 2.0 + build_site.POLL_SLICE_S
    asked.clear()
    clock["t"] = 0.0

    async def never(timeout=None):
        asked.append(timeout)
        clock["t"] += timeout
        raise queue.Empty

    with pytest.raises(queue.Empty):  # a real timeout still ends at the deadline
        _run(build_site._sliced(never, now)(timeout=3))
    assert clock["t"] == pytest.approx(3.0) and max(asked) <= build_site.POLL_SLICE_S


@pytest.mark.parametrize("head", ["## Goals", "**Goals.** After this lesson you can", "**Goals**", "Goals:"])
def test_goals_parsed_from_each_heading_style(tmp_path, head):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# Lesson 09 · Title\n*Sub title.*\n\n{head}\n- first goal;\n"
                                              "- second goal, wrapped\n  over two lines;\n\n**Uses** `x`")]
    path = tmp_path / "09_x.ipynb"
    nbformat.write(nb, path)
    lesson = build_site.read_lesson(path)
    assert (lesson.title, lesson.subtitle) == ("Lesson 09 · Title", "*Sub title.*")
    assert lesson.goals == ["first goal;", "second goal, wrapped over two lines;"]


def test_build_rejects_an_empty_notebooks_folder(tmp_path):
    with pytest.raises(build_site.BuildError, match="no notebooks in"):
        build_site.build(tmp_path / "out", notebooks=tmp_path)


def test_build_never_overwrites_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(build_site.BuildError, match="refusing to overwrite"):
        build_site.build(tmp_path, notebooks=REPO / "notebooks")
    assert (tmp_path / "precious.txt").read_text() == "keep me"
