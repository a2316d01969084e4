"""Sphinx configuration of the course site (Sphinx + MyST-NB + sphinx-book-theme).

``tools/build_site.py`` copies this folder into a staging directory next to the lessons, the
docs, the figures and the vendored JavaScript, and runs ``sphinx-build`` there (MyST-NB executes
the lessons); it sets ``COURSE_SITE_REPO`` so that autodoc and the kernels import this
checkout's ``lessons_lib``.

Offline by construction: MathJax, require.js and the ipywidgets embedder are served from
``_static/`` (copied there from npm tarballs by the build), the theme ships its own fonts
and icons, and nothing else is referenced by URL.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from docutils import nodes
from sphinx import addnodes

REPO = Path(os.environ.get("COURSE_SITE_REPO", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(REPO))

project = "Batching variable-length prompts"
author = "the course authors"
copyright = "the course authors"
language = "en"

extensions = [
    "myst_nb",                 # .md and executed .ipynb pages
    "sphinx.ext.autodoc",      # the API reference, from lessons_lib's docstrings
    "sphinx.ext.autosummary",  # the table of modules on the API index
    "sphinx.ext.viewcode",     # highlighted lessons_lib source, linked from every API entry
    "sphinx.ext.mathjax",
]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
root_doc = "index"

# ---------------------------------------------------------------- notebooks and markdown
# MyST-NB executes every lesson (nbclient, saving the widget state the pages render from), in the
# lesson's own folder so that ../figures resolves. A lesson that fails is a warning with its
# traceback, which tools/build_site.py turns into a failed build. --cell-timeout sets the timeout.
nb_execution_mode = "force"
nb_execution_timeout = 300
nb_execution_in_temp = False
nb_execution_raise_on_error = False
nb_execution_show_tb = True
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# The widget embedder and require.js from _static/, not from a CDN. A widget module that is
# not in the embedder's bundle would be looked up under _static/widget-modules/ and fail
# there, visibly, instead of being fetched from the internet.
nb_ipywidgets_js = {
    "require.js": {},
    "course_widgets.js": {},  # tells require.js where the embedder (and so its fonts) lives
    "html-manager/embed-amd.js": {"data-jupyter-widgets-cdn": "_static/widget-modules/"},
}

# ---------------------------------------------------------------- API reference
# One page per module (api/<module>.rst, written at build start by _write_api_pages below):
# autosummary's recursive mode would take lessons_lib.core.attention for the function
# ``attention`` that lessons_lib/core/__init__.py imports under that name.
autosummary_generate = False
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True
# Docstrings are plain text with ``literals``, not reST: their formatting warnings (docutils) are
# silenced and never fail the build; a module that cannot be imported is still reported (autodoc).
suppress_warnings = ["docutils", "myst.header", "misc.highlighting_failure",
                     "ref.python"]  # a bare name in a lesson that matches two objects stays plain code

# ---------------------------------------------------------------- HTML
html_theme = "sphinx_book_theme"
html_title = "Batching variable-length prompts"
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_js_files = [("mathjax_ipywidgets.js", {"priority": 510})]  # after the MathJax config, before MathJax
html_favicon = "_static/favicon.svg"
html_context = {"default_mode": "auto"}  # light or dark, as the reader's system says; the toggle switches
html_last_updated_fmt = None
html_copy_source = True      # the download button serves the executed .ipynb from _sources/
html_show_sphinx = False
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "use_source_button": False,
    "navigation_with_keys": False,
    "search_bar_text": "Search the course…",
}
mathjax_path = "mathjax/tex-svg-full.js"  # under _static/, MathJax 3 from npm (Sphinx's default is a CDN)
mathjax3_config = {"svg": {"fontCache": "global"}}


# ---------------------------------------------------------------- course additions
DOC_ORDER = ["claims", "article", "benchmarks", "bad_inputs"]  # the rest of docs/ follows, by name
_DOTTED = re.compile(r"lessons_lib(\.\w+)*")
_NAME = re.compile(r"[A-Za-z_]\w*")
_CLAIMS = {"CLAIMS.md", "claims.md", "docs/claims.md"}


def _docs_toctree(app, docname, source):
    """Fill the index's documents toctree with whatever docs/ holds (claims and article may be new)."""
    if docname != "index":
        return
    found = sorted(p.stem for p in (Path(app.srcdir) / "docs").glob("*.md"))
    order = [f"docs/{d}" for d in DOC_ORDER if d in found] + [f"docs/{d}" for d in found if d not in DOC_ORDER]
    if (Path(app.srcdir) / "bench" / "results" / "summary.md").is_file():  # the tables docs/benchmarks.md links to
        order.insert(order.index("docs/benchmarks") + 1 if "docs/benchmarks" in order else len(order),
                     "bench/results/summary")
    source[0] = source[0].replace("<!-- course-docs -->", "\n".join(order))


def lessons_lib_modules(root: Path = REPO) -> list[str]:
    """Every public module of lessons_lib, packages included, sorted by dotted name."""
    names = []
    for path in (root / "lessons_lib").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if path.name == "__init__.py":
            parts = parts[:-1]
        elif path.stem.startswith("_"):
            continue
        names.append(".".join(parts))
    return sorted(names)


def _write_api_pages(app):
    api = Path(app.srcdir) / "api"
    api.mkdir(exist_ok=True)
    for mod in lessons_lib_modules():
        title = mod.replace("_", r"\_")
        (api / f"{mod}.rst").write_text(f"{title}\n{'=' * len(title)}\n\n.. automodule:: {mod}\n", encoding="utf-8")


def _api_index(app, docname, source):
    if docname == "api":
        source[0] = source[0].replace("<!-- course-modules -->", "\n".join(f"   {m}" for m in lessons_lib_modules()))


def _xref(literal, docname, domain, reftype, target, module=None):
    ref = addnodes.pending_xref("", refdomain=domain, reftype=reftype, reftarget=target,
                                refexplicit=True, refwarn=False, refdoc=docname)
    if module:  # a bare name: looked up in that module first, then anywhere (Python domain, searchmode 1)
        ref["refspecific"], ref["py:module"] = True, module
    ref += literal.deepcopy()
    return ref


def _link_literals(app, doctree):
    """Inline code that names lessons_lib (``lessons_lib.core.batch``, or ``pack`` after it in the
    same paragraph) becomes a link to the API reference; ``CLAIMS.md`` to the claims document.
    Names that resolve to nothing stay plain code."""
    has_claims, docname = "docs/claims" in app.env.found_docs, app.env.docname
    for para in doctree.findall(nodes.paragraph):
        last_module = None
        for lit in list(para.findall(nodes.literal)):
            if isinstance(lit.parent, (addnodes.pending_xref, nodes.reference)):
                continue
            text = lit.astext()
            if _DOTTED.fullmatch(text):
                lit.replace_self(_xref(lit, docname, "py", "obj", text))
                last_module = text
            elif last_module and _NAME.fullmatch(text):
                lit.replace_self(_xref(lit, docname, "py", "obj", text, module=last_module))
            elif has_claims and text in _CLAIMS:
                lit.replace_self(_xref(lit, docname, "std", "doc", "/docs/claims"))


def _widget_note(app, doctree, docname):
    """A page with saved widgets says, at the top, that they need a live kernel to move."""
    if not any("application/vnd.jupyter.widget-view+json" in n.astext() for n in doctree.findall(nodes.raw)):
        return
    note = nodes.admonition(classes=["note", "course-widget-note"])
    note += nodes.title(text="Static page")
    note += nodes.paragraph("", "", nodes.Text(
        "The widgets on this page are drawn from the state saved when the site was built: they render, but moving "
        "a slider recomputes nothing, that needs a live Python kernel. To explore, open "),
        nodes.literal(text=f"{docname}.ipynb"), nodes.Text(" in JupyterLab ("), nodes.literal(text="make course"),
        nodes.Text(") and run all cells."))
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is not None and section.children and isinstance(section[0], nodes.title):
        section.insert(1, note)
    else:
        doctree.insert(0, note)


def _serve_executed_notebooks(app, exception):
    """The download button serves ``_sources/<lesson>.ipynb``: Sphinx copies the source there, so
    replace it with the executed lesson (outputs and widget state) that MyST-NB wrote."""
    if exception is not None or app.builder.format != "html":
        return
    executed = Path(app.env.mystnb_config.output_folder)
    for docname in app.env.found_docs:
        if (nb := executed / f"{docname}.ipynb").is_file():
            for served in (Path(app.outdir) / "_sources").glob(f"{docname}.ipynb*"):
                served.write_bytes(nb.read_bytes())


def setup(app):
    app.connect("builder-inited", _write_api_pages)
    app.connect("source-read", _docs_toctree)
    app.connect("source-read", _api_index)
    app.connect("doctree-read", _link_literals)
    app.connect("doctree-resolved", _widget_note)
    app.connect("build-finished", _serve_executed_notebooks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
