"""The course book: built once per session by tools/build_site.py (Sphinx + MyST-NB, which
executes the lessons, + sphinx-book-theme), every page checked in Chromium.

Checks that can fail for real: every lesson, document and lessons_lib module has a page; every
page opens with no console error, no failed request and no request leaving 127.0.0.1 (such a
request is aborted by the test, never sent, and reported); no page references a script, style
or image by an http(s) URL; every lesson page is in the sidebar of the index; the search finds
"cu_seqlens" on lessons 01 and 03; every lesson shows its figures (each <img> decoded with a
non-zero size, markdown figures included); every saved widget is rendered from its state,
with the "needs a live kernel" note; a lesson page has a table of contents, previous/next
links and a download button that serves the executed notebook.
"""
from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
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
from course_browser import ARTIFACTS, chromium_context, skip_or_fail

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
DOCS = sorted((REPO / "docs").glob("*.md"))
MODULES = sorted(".".join(p.relative_to(REPO).with_suffix("").parts[:-1] if p.name == "__init__.py"
                          else p.relative_to(REPO).with_suffix("").parts)
                 for p in (REPO / "lessons_lib").rglob("*.py") if not p.stem.startswith("_") or p.name == "__init__.py")
# Every page a reader can reach: the lessons, the documents, the API reference, the index.
PAGES = (["index.html", "api.html", "search.html", "genindex.html", "py-modindex.html"]
         + [f"notebooks/{p.stem}.html" for p in NOTEBOOKS] + [f"docs/{p.stem}.html" for p in DOCS]
         + [f"api/{m}.html" for m in MODULES]
         + (["bench/results/summary.html"] if (REPO / "bench" / "results" / "summary.md").is_file() else []))
BUILD_TIMEOUT_S = 1200
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
NEEDS = ("sphinx", "myst_nb", "sphinx_book_theme")


def _tell(config, line: str) -> None:
    """Print past pytest's output capture (a session fixture has no capsys)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)


@pytest.fixture(scope="session")
def site(tmp_path_factory, request) -> Path:
    """Build the site once per session into a temp dir (``make site`` builds into site/).
    ``COURSE_SITE_DIR=site`` checks an existing build instead (``make site`` first)."""
    if os.environ.get("COURSE_SITE_DIR"):
        built = Path(os.environ["COURSE_SITE_DIR"]).resolve()
        assert (built / "index.html").is_file(), f"COURSE_SITE_DIR={built} holds no built site"
        return built
    if shutil.which("npm") is None:
        skip_or_fail("npm is needed to fetch the site's widget JS (apt-get install npm)", "the site cannot be built")
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        skip_or_fail(f"{', '.join(missing)} not installed: make setup (requirements.txt, site block)",
                     "the site cannot be built")
    out = tmp_path_factory.mktemp("site")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "build_site.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=REPO)
    log = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        pytest.fail(f"tools/build_site.py exited {proc.returncode}:\n{log[-4000:]}", pytrace=False)
    _tell(request.config, f"\n[site] built {len(NOTEBOOKS)} lessons in {time.monotonic() - t0:.1f} s")
    for line in proc.stdout.splitlines():
        if line.startswith(("executed", "sphinx-build", "site built")):
            _tell(request.config, f"[site]   {line}")
    return out


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


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


@pytest.fixture(scope="module")  # Playwright's driver holds an asyncio loop: stop it with this module
def site_browser(tmp_path_factory):
    with chromium_context(tmp_path_factory.mktemp("site-chromium")) as context:
        yield context


def _open(context, url: str, wait: str = "networkidle"):
    """Open ``url``; return the page and the problems seen: console errors, page errors, failed
    requests, HTTP errors, and any request that would leave the page's origin (aborted here)."""
    page = context.new_page()
    problems, origin = [], "{0.scheme}://{0.netloc}".format(urlparse(url))

    def local(u: str) -> bool:
        return u.startswith((origin + "/", "data:", "blob:", "about:"))

    def abort_remote(route):
        problems.append(f"non-local request: {route.request.url[:120]}")
        route.abort()

    page.route(lambda u: not local(u), abort_remote)
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url[:120]} ({r.failure})")
            if local(r.url) else None)
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url[:120]}") if r.status >= 400 else None)
    page.goto(url, wait_until="load")
    page.wait_for_load_state(wait)
    return page, problems


# ---------------------------------------------------------------- the files (no browser)

def test_notebooks_exist():
    assert NOTEBOOKS, "notebooks/ holds no lesson: nothing to publish"


def test_every_source_has_a_page(site):
    missing = [p for p in PAGES if not (site / p).is_file()]
    assert not missing, f"pages not built: {missing}"
    empty = [m for m in MODULES if f'id="module-{m}"' not in (site / "api" / f"{m}.html").read_text(encoding="utf-8")]
    assert not empty, f"API pages with no autodoc content (module not importable?): {empty}"
    for doc in ("claims", "article"):  # being written: on the site as soon as they exist
        if (REPO / "docs" / f"{doc}.md").is_file():
            assert (site / "docs" / f"{doc}.html").is_file()


_REMOTE_LOAD = re.compile(r"""<(?:script|img|iframe|source|audio|video|embed)\b[^>]*\bsrc=["']?(?:https?:)?//"""
                          r"""|<link\b[^>]*\bhref=["']?(?:https?:)?//[^>]*>|@import\s+(?:url\()?["']?(?:https?:)?//"""
                          r"""|url\(["']?(?:https?:)?//""", re.I)


def test_no_page_or_style_loads_from_the_internet(site):
    """Every HTML, CSS and JS file the site serves: nothing is loaded by URL from elsewhere
    (links a reader may follow are fine; a <link> to a stylesheet or font is not)."""
    offenders = []
    for path in site.rglob("*"):
        if path.suffix not in (".html", ".css") or not path.is_file():
            continue
        for m in _REMOTE_LOAD.finditer(path.read_text(encoding="utf-8", errors="replace")):
            tag = m.group(0)
            if tag.lower().startswith("<link") and re.search(r"""rel=["']?(?:canonical|license|author)""", tag):
                continue
            offenders.append(f"{path.relative_to(site)}: {tag[:120]}")
    assert not offenders, "remote loads:\n" + "\n".join(offenders[:20])


# ---------------------------------------------------------------- every page in Chromium

@pytest.mark.parametrize("rel", PAGES)
def test_page_opens_clean(rel, site, site_url, site_browser):
    page, problems = _open(site_browser, f"{site_url}/{rel}")
    images = page.evaluate("() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))"
                           ".map(i => i.src.slice(0, 100))")
    title = page.title()
    page.close()
    assert not problems, f"{rel}:\n" + "\n".join(problems)
    assert not images, f"{rel}: images that did not render: {images}"
    assert title.strip(), f"{rel} has no title"


def test_sidebar_reaches_every_lesson(site, site_url, site_browser):
    page, problems = _open(site_browser, f"{site_url}/index.html")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "site_index.png"), full_page=False)
    hrefs = page.evaluate("() => [...document.querySelectorAll('.bd-sidebar-primary nav.bd-docs-nav a')]"
                          ".map(a => new URL(a.getAttribute('href'), location.href).pathname)")
    # Follow each lesson link from the sidebar: it must land on that lesson.
    landed = {}
    for nb_path in NOTEBOOKS:
        link = page.locator(f'.bd-sidebar-primary nav.bd-docs-nav a[href$="notebooks/{nb_path.stem}.html"]')
        if link.count():
            link.first.click()
            page.wait_for_load_state("load")
            landed[nb_path.stem] = page.locator("article h1").first.inner_text()
            page.go_back(wait_until="load")
    page.close()
    assert not problems, "\n".join(problems)
    for nb_path in NOTEBOOKS:
        assert f"/notebooks/{nb_path.stem}.html" in hrefs, f"{nb_path.stem} is not in the index's sidebar"
        assert _first_heading(nb_path) in landed.get(nb_path.stem, ""), f"the sidebar link of {nb_path.stem} lands elsewhere"
    for doc in DOCS:
        assert f"/docs/{doc.stem}.html" in hrefs, f"docs/{doc.name} is not in the sidebar"
    assert "/api.html" in hrefs, "the API reference is not in the sidebar"


def _first_heading(nb_path: Path) -> str:
    for cell in nbformat.read(nb_path, as_version=4).cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip().replace("`", "")
    return nb_path.stem


def _search_results(page) -> list[str]:
    page.wait_for_function("() => /found|did not match/i.test((document.querySelector('#search-results') || {}).innerText || '')",
                           timeout=30_000)
    return page.evaluate("() => [...document.querySelectorAll('#search-results ul.search li a')]"
                         ".map(a => new URL(a.getAttribute('href'), location.href).pathname)")


def test_search_finds_cu_seqlens_on_lessons_01_and_03(site, site_url, site_browser):
    lessons = [p.stem for p in NOTEBOOKS if p.stem.startswith(("01_", "03_"))]
    assert len(lessons) == 2, f"expected one lesson 01 and one lesson 03, got {lessons}"
    # The real UI: the search button opens the dialog, type, Enter.
    page, problems = _open(site_browser, f"{site_url}/index.html")
    page.locator(".search-button-field").first.click()
    box = page.locator("#pst-search-dialog input[name='q']")
    box.fill("cu_seqlens")
    box.press("Enter")
    page.wait_for_url(re.compile(r"search\.html\?q=cu_seqlens"))
    page.wait_for_load_state("networkidle")
    found = _search_results(page)
    page.close()
    # The results page on its own, as a link to it would open it.
    page2, problems2 = _open(site_browser, f"{site_url}/search.html?q=cu_seqlens")
    found2 = _search_results(page2)
    page2.close()
    assert not problems + problems2, "\n".join(problems + problems2)
    for stem in lessons:
        assert f"/notebooks/{stem}.html" in found, f"search for cu_seqlens does not find {stem}: {found}"
        assert f"/notebooks/{stem}.html" in found2, f"search.html?q=cu_seqlens does not list {stem}: {found2}"


# In a lesson: every <img> decoded (complete, non-zero natural size), each saved widget view
# replaced by live widget DOM from the html-manager, and the book's page furniture.
LESSON_STATE_JS = """() => ({
    images: [...document.images].map(i => ({src: i.src.slice(0, 100), ok: i.complete && i.naturalWidth > 0,
                                             w: i.naturalWidth, h: i.naturalHeight})),
    views: [...document.querySelectorAll('script[type="%s"]')].map(s =>
        !!s.parentElement.querySelector('.widget-subarea .lm-Widget, .widget-subarea .jupyter-widgets')),
    note: !!document.querySelector('.course-widget-note'),
    toc: [...document.querySelectorAll('.bd-sidebar-secondary nav.page-toc a')].length,
    prev: (document.querySelector('.prev-next-area a.left-prev') || {}).href || null,
    next: (document.querySelector('.prev-next-area a.right-next') || {}).href || null,
    download: [...document.querySelectorAll('.dropdown-download-buttons a')].map(a => a.href).filter(h => h.endsWith('.ipynb')),
    dbxCounts: (document.querySelector('.dbx-counts') || {}).innerText || null,
    frxTable: (document.querySelector('.frx-table') || {}).innerText || null,
})""".replace("%s", WIDGET_VIEW)


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_lesson_page(nb_path, site, site_url, site_browser):
    rel = f"notebooks/{nb_path.stem}.html"
    n_views = (site / rel).read_text(encoding="utf-8").count(f'<script type="{WIDGET_VIEW}">')
    page, problems = _open(site_browser, f"{site_url}/{rel}")
    if n_views:  # the html-manager renders after load; give it a few seconds on 2 cores
        try:
            page.wait_for_function(
                f"""() => [...document.querySelectorAll('script[type="{WIDGET_VIEW}"]')].every(s =>
                    s.parentElement.querySelector('.widget-subarea .lm-Widget, .widget-subarea .jupyter-widgets'))""",
                timeout=30_000)
        except Exception:
            pass  # reported by the assertions below, with what did render
        page.wait_for_load_state("networkidle")
    state = page.evaluate(LESSON_STATE_JS)
    notebook = None
    if state["download"]:
        resp = page.request.get(state["download"][0])
        notebook = nbformat.reads(resp.text(), as_version=4) if resp.ok else None
    shots = ARTIFACTS / "site"
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / f"{nb_path.stem}.png"), full_page=True)
    if nb_path.stem.startswith("03_"):
        page.screenshot(path=str(ARTIFACTS / "site_lesson03.png"), full_page=False)
    page.close()

    assert not problems, f"{rel}:\n" + "\n".join(problems)
    broken = [i for i in state["images"] if not i["ok"]]
    assert not broken, f"{rel}: images that did not render: {broken}"
    assert state["images"], f"{nb_path.name} shows no figure on its page"
    md_figures = re.findall(r"(?:!\[[^\]]*\]\(|<img[^>]*src=[\"'])([^)\"'\s]+)",
                            "\n".join(c.source for c in nbformat.read(nb_path, as_version=4).cells
                                      if c.cell_type == "markdown"))
    for ref in md_figures:
        if ref.startswith(("attachment:", "data:")):
            continue  # embedded in the page, no file name to look for
        stem = Path(ref).stem  # Sphinx serves it from _images/, under its own name
        assert any(stem in i["src"] for i in state["images"]), \
            f"{nb_path.name}: markdown figure {ref} not on the page"
    assert len(state["views"]) == n_views
    assert all(state["views"]), f"{rel}: {state['views'].count(False)} of {n_views} saved widgets did not render"
    if n_views:
        assert state["note"], f"{rel} has widgets but no 'needs a live kernel' note"
    if nb_path.stem.startswith("03_"):  # lesson 03's explorer, drawn from its saved state
        assert re.search(r"varlen: computed \d+ \| useful \d+ \| wasted 0", state["dbxCounts"] or ""), state["dbxCounts"]
    if nb_path.stem.startswith("05_"):  # lesson 05's roofline explorer: one line per packing, each part bounded
        lines = (state["frxTable"] or "").strip().splitlines()
        part = r"[\d.]+ [kMGT]?FLOP [\d.]+ [kMGT]?B [\d.]+ FLOP/B (compute|memory)-bound [\d.e+-]+ ms"
        assert len(lines) >= 2 and all(re.fullmatch(rf".+?: linear {part} \| attention {part} \| predicted [\d.e+-]+ ms"
                                                    r"( \| launch floor [\d.]+ ms \(\d+ kernels at least\): .+)?",
                                                    line.strip()) for line in lines), state["frxTable"]
    # The book's furniture: contents of the page, previous/next, the notebook to download.
    assert state["toc"] >= 2, f"{rel}: no table of contents for the page"
    i = NOTEBOOKS.index(nb_path)
    assert state["prev"], f"{rel}: no link to the previous page"
    if i + 1 < len(NOTEBOOKS):
        assert state["next"] and state["next"].endswith(f"notebooks/{NOTEBOOKS[i + 1].stem}.html"), \
            f"{rel}: next is {state['next']}, not {NOTEBOOKS[i + 1].stem}"
    if i:
        assert state["prev"].endswith(f"notebooks/{NOTEBOOKS[i - 1].stem}.html"), f"{rel}: prev is {state['prev']}"
    assert notebook is not None, f"{rel}: no download button serving the notebook ({state['download']})"
    assert len(notebook.cells) == len(nbformat.read(nb_path, as_version=4).cells)
    assert any(c.get("outputs") for c in notebook.cells if c.cell_type == "code"), "the download is not the executed lesson"


def test_api_reference_links_lessons_and_source(site):
    """A lesson's "Uses" names link into the API reference; API entries link to their source."""
    lesson = (site / "notebooks" / f"{NOTEBOOKS[0].stem}.html").read_text(encoding="utf-8")
    assert re.search(r'href="\.\./api/lessons_lib\.[\w.]+\.html#[^"]*"', lesson), "no lesson -> API link"
    batch = site / "api" / "lessons_lib.core.batch.html"
    assert 'href="../_modules/lessons_lib/core/batch.html' in batch.read_text(encoding="utf-8"), "no API -> source link"
    assert (site / "_modules" / "lessons_lib" / "core" / "batch.html").is_file()


# ---------------------------------------------------------------- the checker can fail

def test_the_checks_catch_a_cdn_script_and_a_broken_image(tmp_path, site_browser):
    """The page checks above fail on what they are meant to catch: a script from a CDN (aborted,
    never sent) and a missing image."""
    (tmp_path / "bad.html").write_text('<!DOCTYPE html><html><head><title>bad</title><link rel="icon" href="data:,">'
                                       '<script src="https://cdn.jsdelivr.net/npm/requirejs@2.3.8/require.js"></script>'
                                       '</head><body><img src="missing.png"></body></html>')
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page, problems = _open(site_browser, f"http://127.0.0.1:{server.server_address[1]}/bad.html", wait="load")
        page.close()
    finally:
        server.shutdown()
        server.server_close()
    assert any(p.startswith("non-local request: https://cdn.jsdelivr.net") for p in problems), problems
    assert any("HTTP 404" in p and "missing.png" in p for p in problems), problems
    assert _REMOTE_LOAD.search((tmp_path / "bad.html").read_text())


# ---------------------------------------------------------------- build_site units (no browser)

sys.path.insert(0, str(REPO / "tools"))
import build_site  # noqa: E402  # tools/ is no package: importable only after the sys.path line above

# The stall MyST-NB's executor would have (a known, still open nbclient bug): after widget cells,
# nbclient's wait for a kernel reply can return only when the whole cell timeout has passed. Here,
# the same call MyST-NB makes (jupyter-cache's single_nb_execution, i.e. nbclient.execute) on
# widget cells like the lessons' explorers, with a short cell timeout: a stall is a CellTimeoutError.
WIDGET_CELL = """s = w.IntSlider(value={i}, min=0, max=10)
out = w.Output()
def draw(change=None):
    out.clear_output(wait=True)
    with out:
        fig, ax = plt.subplots(); ax.plot(range(s.value + 2)); plt.show()
s.observe(draw, "value"); draw()
display(w.VBox([s, out]))"""


def test_myst_nb_executor_does_not_stall_after_widget_cells(tmp_path, monkeypatch):
    from jupyter_cache.executors.utils import single_nb_execution
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    cells = ["import ipywidgets as w\nimport matplotlib.pyplot as plt\nfrom IPython.display import display"]
    for i in range(6):
        cells += [WIDGET_CELL.format(i=i), f"print({i})"]
    for run in range(3):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        res = single_nb_execution(nb, cwd=str(tmp_path), timeout=20, allow_errors=False)
        assert res.err is None, f"run {run}: {res.exc_string[-1500:]}"
        assert [c.outputs[0]["text"] for c in res.nb.cells[2::2]] == [f"{i}\n" for i in range(6)]
        state = res.nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
        assert len([m for m in state.values() if m["model_name"] == "IntSliderModel"]) == 6


def test_executed_lessons_replace_their_sources_for_download(tmp_path):
    """The download button serves _sources/<lesson>.ipynb: conf.py puts MyST-NB's executed copy there."""
    conf = _conf()
    (tmp_path / "jupyter_execute" / "notebooks").mkdir(parents=True)
    (tmp_path / "html" / "_sources" / "notebooks").mkdir(parents=True)
    (tmp_path / "jupyter_execute" / "notebooks" / "09_x.ipynb").write_text("executed")
    for name in ("09_x.ipynb", "10_y.ipynb"):
        (tmp_path / "html" / "_sources" / "notebooks" / name).write_text("source")
    env = type("Env", (), {"found_docs": {"notebooks/09_x", "notebooks/10_y", "index"},
                           "mystnb_config": type("C", (), {"output_folder": str(tmp_path / "jupyter_execute")})()})()
    app = type("App", (), {"env": env, "outdir": str(tmp_path / "html"), "builder": type("B", (), {"format": "html"})()})()
    conf._serve_executed_notebooks(app, None)
    served = tmp_path / "html" / "_sources" / "notebooks"
    assert (served / "09_x.ipynb").read_text() == "executed" and (served / "10_y.ipynb").read_text() == "source"
    assert conf.nb_execution_mode == "force" and conf.nb_execution_in_temp is False


def test_the_build_reads_each_lessons_execution_from_sphinx_output():
    log = ("/tmp/course-site-x/src/notebooks/00_a.ipynb: Executed notebook in 12.34 seconds [mystnb]\n"
           "/tmp/course-site-x/src/notebooks/07_new.ipynb: Executing notebook failed: CellExecutionError [mystnb.exec]\n")
    times, failed = build_site.execution_report(log)
    assert times == {"00_a": 12.34} and len(failed) == 1 and "07_new" in failed[0]


def test_staging_folds_hidden_cells_and_mirrors_the_repo(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Lesson 09 · x"), nbformat.v4.new_code_cell("1")]
    nb.cells[1].metadata["jupyter"] = {"source_hidden": True}
    (tmp_path / "nbs").mkdir()
    nbformat.write(nb, tmp_path / "nbs" / "09_x.ipynb")
    staged = build_site.stage(tmp_path / "src", tmp_path / "nbs", with_js=False)
    assert [p.name for p in staged] == ["09_x.ipynb"]
    assert nbformat.read(staged[0], as_version=4).cells[1].metadata["tags"] == ["hide-input"]
    for name in ("conf.py", "index.md", "api.md", "figures", "docs"):
        assert (tmp_path / "src" / name).exists(), name


def _conf():
    spec = importlib.util.spec_from_file_location("site_conf", REPO / "tools" / "site_assets" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf


def test_docs_toctree_puts_claims_and_article_first(tmp_path):
    conf = _conf()
    (tmp_path / "docs").mkdir()
    app = type("App", (), {"srcdir": str(tmp_path)})()
    for names, want in ((["zeta", "benchmarks", "claims"], ["claims", "benchmarks", "zeta"]),
                        (["article", "bad_inputs", "claims"], ["claims", "article", "bad_inputs"])):
        for f in (tmp_path / "docs").glob("*.md"):
            f.unlink()
        for n in names:
            (tmp_path / "docs" / f"{n}.md").write_text(f"# {n}\n")
        source = ["```{toctree}\n<!-- course-docs -->\n```"]
        conf._docs_toctree(app, "index", source)
        assert source[0] == "```{toctree}\n" + "\n".join(f"docs/{n}" for n in want) + "\n```"


def test_build_rejects_an_empty_notebooks_folder(tmp_path):
    with pytest.raises(build_site.BuildError, match="no notebooks in"):
        build_site.build(tmp_path / "out", notebooks=tmp_path)


def test_build_never_overwrites_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(build_site.BuildError, match="refusing to overwrite"):
        build_site.build(tmp_path, notebooks=REPO / "notebooks")
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_widget_state_saved_in_the_executed_lessons(site):
    """The widget state the pages render from is in the executed notebooks the site serves."""
    with_widgets = 0
    for nb_path in NOTEBOOKS:
        served = json.loads((site / "_sources" / "notebooks" / nb_path.name).read_text(encoding="utf-8"))
        state = served.get("metadata", {}).get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
        with_widgets += bool(state.get("state"))
    assert with_widgets, "no lesson saved any widget state"
