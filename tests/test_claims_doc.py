"""docs/claims.md, the project's own claims document, stays true to the repo: every claim id
has a row, the lesson named there proves it in a claim cell, and the tests it names exist."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
from breakages import BREAKS
from helpers import claim_cells
from test_claims_can_fail import CLAIM_IDS

ROOT = Path(__file__).resolve().parents[1]
ROWS = [line.split("|")[1:-1] for line in (ROOT / "docs" / "claims.md").read_text().splitlines()
        if re.match(r"\| [A-Z]\d+ \|", line)]


def test_every_claim_id_has_one_row_and_one_breakage():
    ids = [r[0].strip() for r in ROWS]
    claimed = {k.split(":")[0] for k in BREAKS}  # "C4:gelu" is a second breakage of C4, not a claim
    assert len(ids) == len(set(ids)) == len(CLAIM_IDS) and set(ids) == claimed


def test_the_lesson_named_proves_the_claim_in_a_claim_cell():
    for row in ROWS:
        claim_id, lesson = row[0].strip(), re.search(r"lesson (\d\d)", row[2]).group(1)
        (path,) = (ROOT / "notebooks").glob(f"{lesson}_*.ipynb")
        assert claim_cells(nbformat.read(path, as_version=4), claim_id), f"{path.name} has no '# claim {claim_id}' cell"
        assert BREAKS[claim_id].notebook == path.stem, f"{claim_id}: its breakage targets {BREAKS[claim_id].notebook}"


def test_the_tests_named_exist():
    for row in ROWS:
        for file, func in re.findall(r"`(test_\w+\.py)::(test_\w+)`", row[3]):
            source = (ROOT / "tests" / file).read_text()
            assert re.search(rf"^def {func}\(", source, re.M), f"{row[0].strip()}: tests/{file} has no {func}"


def test_readme_and_lessons_link_this_document():
    assert "docs/claims.md" in (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = nbformat.read(path, as_version=4).cells[0].source
        assert "docs/claims.md" in first and "CLAIMS.md" not in first, path.name


def _headings(lesson: str) -> list[str]:
    (path,) = (ROOT / "notebooks").glob(f"{lesson}_*.ipynb")
    return [re.sub(r"^#+\s+", "", line).strip() for c in nbformat.read(path, as_version=4).cells
            if c.cell_type == "markdown" for line in c.source.splitlines() if line.startswith("#")]


def test_the_article_walkthrough_points_at_real_headings():
    """docs/article.md says where each point of the article is taught: those sections exist."""
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "article.md").read_text())
    missing = []
    for lesson, refs in re.findall(r'Lesson (\d\d)((?:,? (?:and )?"[^"]+"(?: \([^)]*\))?)+)', text):
        for ref in re.findall(r'"([^"]+)"', refs):
            ref = ref.replace("…", "").strip()
            if not any(h.startswith(ref) or ref in h for h in _headings(lesson)):
                missing.append(f"lesson {lesson}: {ref!r}")
    for lesson, k in re.findall(r"Exercise (\d\d)\.(\d)", text):
        if not any(h.startswith(f"Exercise {lesson}.{k}") for h in _headings(lesson)):
            missing.append(f"Exercise {lesson}.{k}")
    assert not missing, missing
