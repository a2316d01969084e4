#!/usr/bin/env python3
"""Build the course site: Sphinx + MyST-NB execute every lesson and render the book.

    python3 tools/build_site.py [--out site] [--cell-timeout 300]

Sphinx + MyST-NB + sphinx-book-theme do the book (execution of the lessons, navigation,
search, per-page contents, prev/next, download button, themes, API reference from the
docstrings); the configuration is ``tools/site_assets/conf.py`` (``nb_execution_mode =
"force"``: MyST-NB runs each lesson with nbclient, widget state saved). This script only
does what they do not do for us:

1. stage a Sphinx project in a temp dir that mirrors the repo, so a lesson's ``../figures``
   resolves: ``tools/site_assets/*`` + ``notebooks/`` + ``figures/`` + ``docs/*.md`` +
   ``bench/results/``, and ``_static/`` with the JavaScript that the site serves itself;
2. ``sphinx-build`` it in that temp dir (MyST-NB writes the executed notebooks next to the
   HTML, in ``jupyter_execute/``, which must not land beside ``--out``), with the kernels'
   environment (``lessons_lib`` importable, figures inline) and ``--cell-timeout``; fail on a
   lesson that does not execute; then move the HTML into ``--out``.

The JS comes from the npm registry with ``npm pack`` (pinned versions, cached in
``tools/site_assets/.npm-cache/``, git-ignored): the ipywidgets 8 embedder, require.js and
MathJax 3. Nothing on the site is loaded from a CDN.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
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
SITE_MARKER = ".course-site"
DEFAULT_CELL_TIMEOUT_S = 300


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
    """Vendor the page JS into the staging ``_static`` (about 9 MB, mostly the widget embedder)."""
    static.mkdir(parents=True, exist_ok=True)
    shutil.copy2(npm_package(NPM_PACKAGES["requirejs"]) / "require.js", static / "require.js")
    dist = npm_package(NPM_PACKAGES["html-manager"]) / "dist"
    (static / "html-manager").mkdir(exist_ok=True)
    # embed-amd.js finds its fonts next to itself (webpack public path = its own URL).
    for f in [dist / "embed-amd.js", *(p for p in dist.iterdir() if p.suffix in FONT_SUFFIXES)]:
        shutil.copy2(f, static / "html-manager" / f.name)
    (static / "mathjax").mkdir(exist_ok=True)
    shutil.copy2(npm_package(NPM_PACKAGES["mathjax"]) / "es5" / "tex-svg-full.js", static / "mathjax")


# ---------------------------------------------------------------- staging

def stage(src: Path, notebooks: Path, with_js: bool = True) -> list[Path]:
    """Lay out the Sphinx project in ``src``; return the staged lessons, in file order."""
    paths = sorted(notebooks.glob("*.ipynb"))
    shutil.copytree(ASSETS, src, ignore=shutil.ignore_patterns(".npm-cache", "__pycache__", ".gitignore"))
    if with_js:
        install_static(src / "_static")
    (src / "notebooks").mkdir()
    for p in paths:
        nb = nbformat.read(p, as_version=4)
        for cell in nb.cells:  # cells collapsed in JupyterLab (exercise solutions) stay folded
            if cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"):
                tags = cell.metadata.setdefault("tags", [])
                if "hide-input" not in tags:
                    tags.append("hide-input")
        nbformat.write(nb, src / "notebooks" / p.name)
    for name in ("figures", "bench/results"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name)
    (src / "figures").mkdir(exist_ok=True)
    (src / "docs").mkdir()
    for doc in sorted((REPO / "docs").glob("*.md")):
        shutil.copy2(doc, src / "docs" / doc.name)
    return [src / "notebooks" / p.name for p in paths]


# ---------------------------------------------------------------- execution (by MyST-NB)

EXECUTED = re.compile(r"(?:^|/)notebooks/([^/:\s]+?)(?:\.ipynb)?: Executed notebook in ([\d.]+) seconds")
FAILED = re.compile(r"Executing notebook failed|Notebook exception traceback saved")


def execution_report(log: str) -> tuple[dict[str, float], list[str]]:
    """From sphinx-build's output: seconds per executed lesson, and the warnings of any that failed."""
    times = {m[1]: float(m[2]) for m in EXECUTED.finditer(log.replace("\\", "/"))}
    return times, [line for line in log.splitlines() if FAILED.search(line)]


# ---------------------------------------------------------------- build

def _fresh_output_dir(out: Path) -> None:
    """Empty ``out`` for a new build, but only if it is empty or a previous site (marker file):
    ``--out .`` must never wipe the repo."""
    if out.exists() and any(out.iterdir()):
        if not (out / SITE_MARKER).is_file():
            raise BuildError(f"--out {out} is not empty and holds no {SITE_MARKER} from a previous build; "
                             "refusing to overwrite it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def build(out: Path, notebooks: Path = REPO / "notebooks", cell_timeout: int = DEFAULT_CELL_TIMEOUT_S,
          log=print) -> list[Path]:
    t_start = time.monotonic()
    if not any(notebooks.glob("*.ipynb")):
        raise BuildError(f"no notebooks in {notebooks}")
    _fresh_output_dir(out)
    with tempfile.TemporaryDirectory(prefix="course-site-") as tmp:
        src, html = Path(tmp) / "src", Path(tmp) / "html"
        lessons = stage(src, notebooks)
        # sphinx-build and the kernels MyST-NB starts get this (this process's environment stays as
        # it is): lessons_lib importable, figures drawn inline into the page.
        env = dict(os.environ, COURSE_SITE_REPO=str(REPO), MPLBACKEND="module://matplotlib_inline.backend_inline",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-d", str(Path(tmp) / "doctrees"),
                               "-D", f"nb_execution_timeout={cell_timeout}", str(src), str(html)],
                              env=env, capture_output=True, text=True)
        output = proc.stdout + "\n" + proc.stderr
        times, failed = execution_report(output)
        for path in lessons:
            if path.stem in times:
                log(f"executed {path.name} in {times[path.stem]:.1f} s")
        if proc.returncode != 0 or failed:
            raise BuildError(f"sphinx-build exited {proc.returncode}" + (f", a lesson failed: {failed[0]}" if failed else "")
                             + f":\n{proc.stderr.strip()[-4000:]}")
        if missing := [p.name for p in lessons if p.stem not in times]:
            raise BuildError(f"MyST-NB did not report executing {missing}:\n{output.strip()[-2000:]}")
        warnings = [w for w in proc.stderr.splitlines() if "WARNING" in w or "ERROR" in w]
        t_exec = sum(times.values())
        log(f"sphinx-build executed and rendered the book in {time.monotonic() - t_start:.1f} s "
            f"(lessons {t_exec:.1f} s; {len(warnings)} warnings)")
        for w in warnings[:20]:
            log(f"  {w}")
        shutil.copytree(html, out, dirs_exist_ok=True)
    (out / SITE_MARKER).write_text("built by tools/build_site.py; the whole folder is replaced on rebuild\n")
    log(f"site built in {time.monotonic() - t_start:.1f} s (execution {t_exec:.1f} s): "
        f"{out}/index.html ({len(lessons)} lessons)")
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
