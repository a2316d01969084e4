#!/usr/bin/env python3
"""Build the static course site: execute every lesson, render it to HTML, index the goals.

    python3 tools/build_site.py [--out site] [--cell-timeout 60]

Layout of the output (mirrors the repo, so a lesson's ``../figures/x.png`` resolves as is):
    site/index.html               the lessons, in file order, with their Goals
    site/notebooks/NN_name.html   one executed lesson per page (nbconvert, JupyterLab look)
    site/figures/                 every figure (the repo's plus any a lesson regenerated)
    site/_static/                 require.js, the widget manager (embed-amd.js + fonts),
                                  MathJax 3, course.css: nothing is loaded from a CDN

Widgets render offline from the widget state saved during execution; moving them needs a
live kernel, and every page that has widgets says so.

The JS comes from the npm registry with ``npm pack`` (pinned versions, cached in
``tools/site_assets/.npm-cache/``, git-ignored). Lessons run in a temporary copy of the
course (notebooks + figures + a link to lessons_lib), so a build never writes into the repo.

Execution guards against a known nbclient stall (jupyter/nbclient#312: after widget
cells, waiting for a kernel message can return only when the whole timeout has passed):
the kernel client's channels are polled in short slices, so a missed wake-up costs at
most ``POLL_SLICE_S``, and a cell that really hangs fails after ``--cell-timeout``.
"""
from __future__ import annotations

import argparse
import html
import os
import queue
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tools" / "site_assets"
NPM_CACHE = ASSETS / ".npm-cache"
# html-manager 1.x is the ipywidgets 8 embedder (widget state version_major 2).
NPM_PACKAGES = {
    "html-manager": "@jupyter-widgets/html-manager@1.0.15",
    "requirejs": "requirejs@2.3.8",
    "mathjax": "mathjax@3.2.2",
}
FONT_SUFFIXES = (".woff2", ".woff", ".ttf", ".eot", ".svg")
POLL_SLICE_S = 0.5
SITE_MARKER = ".course-site"
DEFAULT_CELL_TIMEOUT_S = 60


class BuildError(RuntimeError):
    pass


# ---------------------------------------------------------------- static JS from npm

def npm_package(spec: str, cache: Path = NPM_CACHE) -> Path:
    """Unpacked ``package/`` dir of an npm ``name@version``, fetched once with ``npm pack``."""
    dest = cache / re.sub(r"[^A-Za-z0-9.@_-]", "_", spec)
    if (dest / "package" / "package.json").is_file():
        return dest / "package"
    npm = shutil.which("npm")
    if npm is None:
        raise BuildError(f"npm is needed to fetch {spec} (the site serves the widget JS itself); "
                         "install Node.js and npm (Debian: apt-get install npm)")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        proc = subprocess.run([npm, "pack", spec, "--pack-destination", tmp, "--cache", str(cache / "_npm")],
                              capture_output=True, text=True, timeout=300)
        tarballs = list(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or len(tarballs) != 1:
            raise BuildError(f"npm pack {spec} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        unpack = Path(tmp) / "unpacked"
        with tarfile.open(tarballs[0]) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(unpack, filter="data")
            else:  # Python < 3.11.4: npm tarballs hold only package/... regular files
                tar.extractall(unpack)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.move(str(unpack), dest)
    return dest / "package"


def install_static(static: Path) -> None:
    """Copy the page JS/CSS into ``site/_static`` (about 9 MB, mostly the widget manager)."""
    static.mkdir(parents=True, exist_ok=True)
    shutil.copy2(npm_package(NPM_PACKAGES["requirejs"]) / "require.js", static / "require.js")
    dist = npm_package(NPM_PACKAGES["html-manager"]) / "dist"
    (static / "html-manager").mkdir(exist_ok=True)
    # embed-amd.js finds its fonts next to itself (webpack public path = its own URL).
    for f in [dist / "embed-amd.js", *(p for p in dist.iterdir() if p.suffix in FONT_SUFFIXES)]:
        shutil.copy2(f, static / "html-manager" / f.name)
    (static / "mathjax").mkdir(exist_ok=True)
    shutil.copy2(npm_package(NPM_PACKAGES["mathjax"]) / "es5" / "tex-svg-full.js", static / "mathjax")
    shutil.copy2(ASSETS / "course.css", static / "course.css")


# ---------------------------------------------------------------- lesson metadata

@dataclass
class Lesson:
    path: Path
    title: str
    subtitle: str = ""
    goals: list[str] = field(default_factory=list)
    goals_intro: str = ""  # e.g. "After this lesson you can"

    @property
    def html_name(self) -> str:
        return self.path.stem + ".html"


# "## Goals", "**Goals**", "**Goals.** After this lesson you can", "Goals:" (+ an optional lead-in).
_GOALS_HEAD = re.compile(r"^\s*(?:#{1,6}\s*Goals?\b[.:]?|\*\*Goals?[.:]?\*\*[.:]?|Goals?:)\s*(.*)$", re.I)
_BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+(.*)$")
_HEADING = re.compile(r"^\s*#{1,6}\s+(.*?)\s*#*\s*$")
_BOLD_LABEL = re.compile(r"^\s*\*\*[^*]+\*\*")


def read_lesson(path: Path) -> Lesson:
    """Title (first ``#`` heading), subtitle (the line after it) and Goals bullets of a lesson."""
    nb = nbformat.read(path, as_version=4)
    lines = [line for cell in nb.cells if cell.cell_type == "markdown" for line in cell.source.splitlines()]
    title, subtitle, goals, intro = "", "", [], ""
    for i, line in enumerate(lines):
        m = _HEADING.match(line)
        if m and line.lstrip().startswith("# "):
            title = m[1]
            for nxt in lines[i + 1:]:
                if nxt.strip():
                    if not (_HEADING.match(nxt) or _GOALS_HEAD.match(nxt) or _BOLD_LABEL.match(nxt)
                            or _BULLET.match(nxt)):
                        subtitle = nxt.strip()
                    break
            break
    for i, line in enumerate(lines):
        m = _GOALS_HEAD.match(line)
        if not m:
            continue
        intro = m[1].strip()
        for nxt in lines[i + 1:]:
            b = _BULLET.match(nxt)
            if b:
                goals.append(b[1].strip())
            elif goals and nxt.startswith((" ", "\t")) and nxt.strip():
                goals[-1] += " " + nxt.strip()  # a bullet wrapped over two lines
            elif nxt.strip() or goals:
                break
        break
    return Lesson(path, title or path.stem, subtitle, goals, intro)


def _inline_markdown(text: str) -> str:
    """Markdown of one goal -> inline HTML (code, emphasis, math left for MathJax)."""
    from nbconvert.filters.markdown import markdown2html
    out = markdown2html(text).strip()
    return re.sub(r"^<p>(.*)</p>$", r"\1", out, flags=re.S)


def write_index(lessons: list[Lesson], out: Path) -> None:
    items = []
    for lesson in lessons:
        goals = "".join(f"<li>{_inline_markdown(g)}</li>" for g in lesson.goals) or \
            "<li><em>This lesson has no Goals section.</em></li>"
        sub = f'<p class="subtitle">{_inline_markdown(lesson.subtitle)}</p>' if lesson.subtitle else ""
        intro = _inline_markdown(lesson.goals_intro) if lesson.goals_intro else ""
        items.append(f'<section class="lesson" data-notebook="{html.escape(lesson.path.name)}">'
                     f'<h2><a href="notebooks/{html.escape(lesson.html_name)}">{html.escape(lesson.title)}</a></h2>'
                     f'{sub}<p><strong>Goals.</strong> {intro}</p><ul class="goals">{goals}</ul></section>')
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>Course: batching variable-length prompts</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="_static/course.css">
<script>window.MathJax = {{tex: {{inlineMath: [['$', '$'], ['\\\\(', '\\\\)']]}}}};</script>
<script src="_static/mathjax/tex-svg-full.js" defer></script>
</head><body class="course-index">
<h1>Batching variable-length prompts: the course</h1>
<p>Every lesson below was executed when this site was built; its figures and claim checks are
the real output. Widgets are shown from their saved state: to move them you need a live
kernel, so open the notebooks in JupyterLab (<code>make course</code>).</p>
{''.join(items)}
</body></html>
"""
    (out / "index.html").write_text(page, encoding="utf-8")


# ---------------------------------------------------------------- execution

def _sliced(get_msg, clock=time.monotonic):
    """Wrap a channel's ``get_msg`` so that one long wait becomes many short polls."""
    async def get_msg_sliced(timeout=None, **kwargs):
        deadline = None if timeout is None else clock() + timeout
        while True:
            left = POLL_SLICE_S if deadline is None else max(0.0, min(POLL_SLICE_S, deadline - clock()))
            try:
                return await get_msg(timeout=left, **kwargs)
            except queue.Empty:
                if deadline is not None and clock() >= deadline:
                    raise
    return get_msg_sliced


def execute(path: Path, workdir: Path, cell_timeout: int) -> tuple[nbformat.NotebookNode, float, list]:
    """Run one lesson in ``workdir``; return (notebook with outputs and widget state, seconds, cell times)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    class SlicedPollClient(NotebookClient):
        async def async_start_new_kernel_client(self):
            kc = await super().async_start_new_kernel_client()
            for channel in (kc.shell_channel, kc.iopub_channel):
                channel.get_msg = _sliced(channel.get_msg)
            return kc

    nb = nbformat.read(path, as_version=4)
    client = SlicedPollClient(nb, timeout=cell_timeout, kernel_name="python3", allow_errors=False,
                              store_widget_state=True, record_timing=True,
                              resources={"metadata": {"path": str(workdir)}})
    t0 = time.monotonic()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
        raise BuildError(f"{path.name}: execution failed: {str(exc)[-2000:]}") from None
    cell_times = []
    for i, cell in enumerate(nb.cells):
        ex = cell.get("metadata", {}).get("execution", {})
        if "iopub.status.busy" in ex and "shell.execute_reply" in ex:
            a, b = (datetime.fromisoformat(ex[k].replace("Z", "+00:00"))
                    for k in ("iopub.status.busy", "shell.execute_reply"))
            cell_times.append(((b - a).total_seconds(), i))
        cell.get("metadata", {}).pop("execution", None)  # timestamps are noise on the page
    return nb, time.monotonic() - t0, sorted(cell_times, reverse=True)


# ---------------------------------------------------------------- rendering

def _exporter():
    from nbconvert import HTMLExporter
    return HTMLExporter(template_name="course", extra_template_basedirs=[str(ASSETS / "templates")],
                        require_js_url="../_static/require.js",
                        widget_renderer_url="../_static/html-manager/embed-amd.js")


_IPYNB_HREF = re.compile(r'href="((?:\./)?)([^"/#?]+)\.ipynb(#[^"]*)?"')


def render(nb, lesson: Lesson, prev: Lesson | None, nxt: Lesson | None, exporter) -> str:
    resources = {"metadata": {"name": lesson.title},
                 "course": {"static": "../_static", "notebook": lesson.path.name,
                            "prev": prev and {"href": prev.html_name, "title": prev.title},
                            "next": nxt and {"href": nxt.html_name, "title": nxt.title}}}
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    # Links between lessons point at the rendered pages.
    return _IPYNB_HREF.sub(lambda m: f'href="{m[1]}{m[2]}.html{m[3] or ""}"', body)


def _fresh_output_dir(out: Path) -> None:
    """Empty ``out`` for a new build, but only if it is empty or a previous site (marker file):
    ``--out .`` must never wipe the repo."""
    if out.exists() and any(out.iterdir()):
        if not (out / SITE_MARKER).is_file():
            raise BuildError(f"--out {out} is not empty and holds no {SITE_MARKER} from a previous build; "
                             "refusing to overwrite it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / SITE_MARKER).write_text("built by tools/build_site.py; the whole folder is replaced on rebuild\n")


def build(out: Path, notebooks: Path = REPO / "notebooks", cell_timeout: int = DEFAULT_CELL_TIMEOUT_S,
          log=print) -> list[Lesson]:
    paths = sorted(notebooks.glob("*.ipynb"))
    if not paths:
        raise BuildError(f"no notebooks in {notebooks}")
    t_start = time.monotonic()
    lessons = [read_lesson(p) for p in paths]
    _fresh_output_dir(out)
    install_static(out / "_static")
    (out / "notebooks").mkdir()
    exporter = _exporter()
    with tempfile.TemporaryDirectory(prefix="course-site-") as tmp:
        course = Path(tmp)
        work = course / "notebooks"
        shutil.copytree(notebooks, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        if (REPO / "figures").is_dir():
            shutil.copytree(REPO / "figures", course / "figures")
        else:
            (course / "figures").mkdir()
        (course / "lessons_lib").symlink_to(REPO / "lessons_lib")
        # Kernels inherit this: lessons_lib importable, figures drawn inline into the page.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
        for i, lesson in enumerate(lessons):
            nb, secs, cell_times = execute(work / lesson.path.name, work, cell_timeout)
            slow = ", ".join(f"cell {c} {s:.1f} s" for s, c in cell_times[:2])
            log(f"executed {lesson.path.name} in {secs:.1f} s (slowest: {slow})")
            page = render(nb, lesson, lessons[i - 1] if i else None, lessons[i + 1] if i + 1 < len(lessons) else None,
                          exporter)
            (out / "notebooks" / lesson.html_name).write_text(page, encoding="utf-8")
        shutil.copytree(course / "figures", out / "figures")
    write_index(lessons, out)
    log(f"site built in {time.monotonic() - t_start:.1f} s: {out}/index.html ({len(lessons)} lessons)")
    return lessons


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "site", help="output folder (default: site/)")
    ap.add_argument("--notebooks", type=Path, default=REPO / "notebooks", help="lessons folder")
    ap.add_argument("--cell-timeout", type=int, default=DEFAULT_CELL_TIMEOUT_S,
                    help=f"seconds one cell may run before the build fails (default {DEFAULT_CELL_TIMEOUT_S})")
    args = ap.parse_args(argv)
    if args.cell_timeout < 1:
        ap.error(f"--cell-timeout must be >= 1 second, got {args.cell_timeout}")
    try:
        build(args.out.resolve(), args.notebooks.resolve(), args.cell_timeout)
    except BuildError as exc:
        print(f"build_site: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
