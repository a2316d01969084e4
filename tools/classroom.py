"""The classroom: a student release of the lessons without solutions, and autograding, with nbgrader.

    python tools/classroom.py check   [LESSON.ipynb ...]               which lessons follow the exercise layout
    python tools/classroom.py release [--build DIR] [--partial] [LESSON.ipynb ...]     (make classroom)
    python tools/classroom.py grade   [--build DIR] [SUBMISSIONS]                       (make grade)

The source notebooks in notebooks/ stay the single source. Each exercise there is four cells:

1. markdown ``### Exercise NN.k · title`` and the task;
2. the answer cell (tag ``exercise``, no nbgrader metadata): the stub ``def my_x(...): raise
   NotImplementedError`` and ``L.check_x(my_x);``. nbgrader leaves an unmarked cell alone, so the
   student's code in it is what gets graded;
3. the reference cell (tag ``solution``, nbgrader solution cell ``exNN_k_reference``): everything
   between ``### BEGIN SOLUTION`` and ``### END SOLUTION``. The release replaces it with CODE_STUB,
   a comment, so that the student notebook still runs top to bottom;
4. the grade cell (tag ``grade``, locked nbgrader grade cell ``exNN_k_grade`` with points): a
   ``### BEGIN HIDDEN TESTS`` region calling ``score(L.check_x, my_x, points=P)``. The release
   empties it; autograding restores it from the gradebook, runs it, and takes the number it
   returns as partial credit (nbgrader.utils.determine_grade).

``release`` copies each lesson into BUILD/source/<lesson>/, runs nbgrader's generate_assignment
(BUILD/release/<lesson>/, the gradebook BUILD/gradebook.db), then scans every student notebook
for the reference code and the hidden tests and refuses a release that leaks one line.
``grade`` copies a folder of submissions (``<student>/<lesson>.ipynb``, any depth below the
student's folder) into BUILD/submitted/, autogrades them with this Python's kernel, writes
nbgrader's HTML feedback plus a plain summary per student and lesson, and the score tables
BUILD/scores.csv (one row per student) and BUILD/scores_by_exercise.csv (one row per student
and exercise, with the checker's explanation).
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "notebooks"
BUILD = ROOT / "build" / "classroom"
COURSE_ID = "varlen-prefill"

CODE_STUB = ("# The reference solution is not part of the student release:\n"
             "# your teacher shares it after grading. Write your answer in the cell above.")
BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_TESTS, END_TESTS = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
HEADING = re.compile(r"^#{2,4}\s*Exercise\s+(\d+)\.(\d+)\s*[·:\-–—]\s*(.+)$")
DEF = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.M)

# Files next to the lessons that are not lessons or helpers (everything else beside a notebook ships with it).
NOT_HELPERS = {"__pycache__", ".ipynb_checkpoints"}

CONFIG = '''\
# Written by tools/classroom.py (make classroom) on every build: change it there, not here.
# nbgrader reads it when run from this folder (nbgrader formgrader, nbgrader autograde ...).
c = get_config()  # noqa: F821  # nbgrader defines get_config() when it reads this file
c.CourseDirectory.course_id = {course_id!r}
# A submitted lessons_lib/ must never shadow the installed one while grading.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", ".*", "lessons_lib"]
# The reference cell becomes a comment, not nbgrader's `raise NotImplementedError()`: the rest of
# the lesson must still run when the student has not looked at it.
c.ClearSolutions.code_stub = {{"python": {stub!r}}}
# A lesson cell (the engine, two TP processes) may take a minute on a loaded 2-core CPU; a student's
# endless loop costs this much per cell.
c.Execute.timeout = 300
# The kernel's own log (e.g. ipykernel's "running over TCP" warning) is noise in make grade's output.
c.Execute.extra_arguments = ["--HistoryManager.hist_file=:memory:", "--IPKernelApp.log_level=ERROR"]
# Any stderr output in a grade cell scores 0: drop Python warnings from the outputs before scoring.
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = r"\\w*Warning: "
# A grade cell a student deleted comes back from the gradebook.
c.OverwriteCells.add_missing_cells = True
'''

STUDENT_README = """\
# Varlen prefill batching: the student release

One folder per lesson; each holds one notebook. Work through them in order ({first} to {last}).

**Setup.** The notebooks import `lessons_lib`, the course's small engine. On the class
JupyterHub it is installed for you. On your own machine, in a clone of the course repository,
run `make setup` (it creates `.venv` with the course's requirements and installs `lessons_lib`
into it), then open these notebooks with that environment's Jupyter:
`.venv/bin/jupyter lab <this folder>`.

**Exercises.** Under each "Exercise" heading, replace `raise NotImplementedError` with your code
and run the cell: its checker prints ✓ when your function is right, says "not attempted yet"
while it is a stub, and otherwise stops with the input your function got wrong and a hint.
Leave the two collapsed cells below each exercise as they are: they are used for grading.

**Handing in.** Submit through the Assignments tab on JupyterHub, or hand in each notebook under
its own file name. Lessons in this release: {lessons}.
"""


class ClassroomError(RuntimeError):
    """Something a teacher must fix before the release or the grading can go on (the message says what)."""


# ---- the exercise layout ---------------------------------------------------------------------------

@dataclass
class Exercise:
    """One exercise of a lesson: where its four cells are and what they define."""

    number: str                 # "03.1"
    answer_index: int
    reference_index: int
    grade_index: int
    answer_name: str            # my_causal_varlen
    reference_name: str         # reference_causal_varlen
    grade_id: str               # ex03_1_grade
    points: float
    reference_code: str         # between the solution delimiters
    hidden_tests: str           # between the hidden-test delimiters


@dataclass
class Lesson:
    path: Path
    exercises: list[Exercise] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def ok(self) -> bool:
        return not self.problems


def source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def region(text: str, begin: str, end: str) -> str | None:
    """The lines strictly between ``begin`` and ``end`` (None when the region is missing or open)."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if begin in line]
    ends = [i for i, line in enumerate(lines) if end in line]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        return None
    return "\n".join(lines[starts[0] + 1:ends[0]])


def read_notebook(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def parse_lesson(path: Path, nb: dict | None = None) -> Lesson:
    """Find the exercises of a lesson and everything that keeps it from the classroom layout."""
    nb = read_notebook(path) if nb is None else nb
    lesson = Lesson(Path(path))
    cells = nb["cells"]
    prefix = re.match(r"(\d+)_", lesson.path.name)
    claimed: set[int] = set()
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        heads = [m for m in (HEADING.match(line.strip()) for line in source(cell).split("\n")) if m]
        if not heads:
            continue
        if len(heads) > 1:
            lesson.problems.append(f"cell {i}: {len(heads)} exercise headings in one markdown cell: one per exercise")
        m = heads[-1]
        nn, k = m.group(1), m.group(2)
        where = f"exercise {nn}.{k}"
        if prefix and nn != prefix.group(1):
            lesson.problems.append(f"{where}: numbered {nn}.{k} in lesson {prefix.group(1)}")
        j = i + 1
        while j < len(cells) and cells[j]["cell_type"] == "markdown" and not _has_heading(cells[j]):
            j += 1
        if j + 2 >= len(cells):
            lesson.problems.append(f"{where}: needs an answer, a reference and a grade cell after its heading")
            continue
        problems = _check_exercise(where, nn, k, cells[j], cells[j + 1], cells[j + 2])
        lesson.problems += problems
        claimed |= {j, j + 1, j + 2}
        if problems:
            continue
        answer, reference, grade = (source(cells[x]) for x in (j, j + 1, j + 2))
        meta = cells[j + 2]["metadata"]["nbgrader"]
        lesson.exercises.append(Exercise(
            number=f"{nn}.{k}", answer_index=j, reference_index=j + 1, grade_index=j + 2,
            answer_name=DEF.search(answer).group(1), reference_name=DEF.search(region(reference, BEGIN_SOLUTION,
                                                                                       END_SOLUTION)).group(1),
            grade_id=meta["grade_id"], points=float(meta["points"]),
            reference_code=region(reference, BEGIN_SOLUTION, END_SOLUTION),
            hidden_tests=region(grade, BEGIN_TESTS, END_TESTS)))
    for i, cell in enumerate(cells):
        if i in claimed:
            continue
        text = source(cell)
        if "solution" in tags(cell) or "grade" in tags(cell):
            lesson.problems.append(f"cell {i}: tagged {tags(cell)} but not one of an exercise's four cells "
                                   "(old layout? see tools/classroom.py)")
        if cell.get("metadata", {}).get("nbgrader"):
            lesson.problems.append(f"cell {i}: nbgrader metadata outside an exercise's reference and grade cells")
        for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
            if marker in text:
                lesson.problems.append(f"cell {i}: the text {marker!r} outside a reference or grade cell "
                                       "(nbgrader would treat it as a region)")
    if not lesson.exercises and not lesson.problems:
        lesson.problems.append("no '### Exercise NN.k · title' heading: nothing to grade")
    if lesson.exercises and not any(re.search(r"(import[^\n]*\bscore\b|def score\b)", source(c))
                                    for c in cells if c["cell_type"] == "code"):
        lesson.problems.append("the grade cells call score() but no cell imports it "
                               "(from lessons_lib.course.grading import score)")
    return lesson


def _has_heading(cell) -> bool:
    return any(HEADING.match(line.strip()) for line in source(cell).split("\n"))


def _check_exercise(where: str, nn: str, k: str, answer: dict, reference: dict, grade: dict) -> list[str]:
    out = []
    a_src, r_src, g_src = source(answer), source(reference), source(grade)
    marked = any(c.get("metadata", {}).get("nbgrader") for c in (answer, reference, grade))
    if "exercise" not in tags(answer) and not marked:
        return [f"{where}: still in the old layout (no answer cell tagged 'exercise', no nbgrader metadata): convert it "
                "to answer, reference and grade cells (tools/classroom.py docstring)"]
    # 2. the answer cell
    if answer["cell_type"] != "code" or "exercise" not in tags(answer):
        out.append(f"{where}: the first code cell after the heading must be the answer cell, tagged 'exercise'")
    if answer.get("metadata", {}).get("nbgrader"):
        out.append(f"{where}: the answer cell must carry no nbgrader metadata (an unmarked cell keeps the student's code)")
    answer_def = DEF.search(a_src)
    if "raise NotImplementedError" not in a_src or not answer_def:
        out.append(f"{where}: the answer cell must define the stub function and `raise NotImplementedError`")
    elif not re.search(rf"\bcheck_\w+\(\s*{answer_def.group(1)}\s*\)", a_src):
        name = answer_def.group(1)
        out.append(f"{where}: the answer cell must call its checker on {name} (L.check_...({name});)")
    # 3. the reference cell
    meta = reference.get("metadata", {}).get("nbgrader") or {}
    ref_id = f"ex{nn}_{k}_reference"
    if reference["cell_type"] != "code" or "solution" not in tags(reference):
        out.append(f"{where}: the cell after the answer must be the reference cell, tagged 'solution'")
    if not (meta.get("solution") is True and meta.get("grade") is False and meta.get("locked") is False
            and meta.get("grade_id") == ref_id):
        out.append(f"{where}: the reference cell needs nbgrader metadata {{grade: false, solution: true, locked: false, "
                   f"grade_id: {ref_id!r}, schema_version: 3}}, has {meta or 'none'}")
    if not reference.get("metadata", {}).get("jupyter", {}).get("source_hidden"):
        out.append(f"{where}: the reference cell must stay collapsed (metadata jupyter.source_hidden: true)")
    code = region(r_src, BEGIN_SOLUTION, END_SOLUTION)
    if code is None or r_src.strip().split("\n")[0].strip() != BEGIN_SOLUTION \
            or r_src.strip().split("\n")[-1].strip() != END_SOLUTION:
        out.append(f"{where}: the reference cell must be exactly one region '{BEGIN_SOLUTION}' ... '{END_SOLUTION}'")
    elif not DEF.search(code):
        out.append(f"{where}: the reference region defines no function")
    # 4. the grade cell
    meta = grade.get("metadata", {}).get("nbgrader") or {}
    grade_id = f"ex{nn}_{k}_grade"
    if grade["cell_type"] != "code" or "grade" not in tags(grade):
        out.append(f"{where}: the cell after the reference must be the grade cell, tagged 'grade'")
    points = meta.get("points")
    if not (meta.get("grade") is True and meta.get("solution") is False and meta.get("locked") is True
            and meta.get("grade_id") == grade_id and isinstance(points, (int, float)) and points > 0):
        out.append(f"{where}: the grade cell needs nbgrader metadata {{grade: true, solution: false, locked: true, "
                   f"points: P > 0, grade_id: {grade_id!r}, schema_version: 3}}, has {meta or 'none'}")
    tests = region(g_src, BEGIN_TESTS, END_TESTS)
    if tests is None:
        out.append(f"{where}: the grade cell must hold one region '{BEGIN_TESTS}' ... '{END_TESTS}'")
    elif answer_def and not re.search(rf"\bscore\(\s*[\w.]+\s*,\s*{answer_def.group(1)}\s*,\s*points\s*=\s*([\d.]+)\s*\)", tests):
        out.append(f"{where}: the hidden tests must call score(L.check_..., {answer_def.group(1)}, points=P)")
    else:
        m = re.search(r"points\s*=\s*([\d.]+)", tests)
        if m and isinstance(points, (int, float)) and float(m.group(1)) != float(points):
            out.append(f"{where}: score(..., points={m.group(1)}) differs from the cell's nbgrader points {points}")
    return out


def lessons_in(paths: list[str] | None) -> list[Path]:
    found = [Path(p) for p in paths] if paths else sorted(LESSONS.glob("[0-9]*.ipynb"))
    missing = [str(p) for p in found if not p.is_file()]
    if missing:
        raise ClassroomError(f"no such notebook: {', '.join(missing)}")
    return found


# ---- what must not reach a student -------------------------------------------------------------------

def _code_lines(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.split("\n")) if s and not s.startswith("#")}


def secret_lines(path: Path, nb: dict | None = None) -> dict[str, set[str]]:
    """Per exercise, the reference and hidden-test lines a student may not see: every code line of
    the regions that does not also appear in a cell the student gets anyway (``return out``, an
    import ...). The reference function's name counts too."""
    nb = read_notebook(path) if nb is None else nb
    lesson = parse_lesson(path, nb)
    hidden = {x for e in lesson.exercises for x in (e.reference_index, e.grade_index)}
    visible = set().union(*(_code_lines(source(c)) for i, c in enumerate(nb["cells"]) if i not in hidden))
    return {e.number: (_code_lines(e.reference_code) | _code_lines(e.hidden_tests) | {e.reference_name}) - visible
            for e in lesson.exercises}


def leaks(release_nb: dict, secrets: dict[str, set[str]]) -> list[str]:
    """The secret lines found in a student notebook: as a line of any cell, inside a longer line (12 characters
    or more), or, for the reference function's name, anywhere (outputs and metadata included)."""
    text = json.dumps(release_nb, ensure_ascii=False)
    sources = "\n".join(source(c) for c in release_nb["cells"])
    lines = _code_lines(sources)
    found = []
    for number, secret in secrets.items():
        for line in sorted(secret):
            if line in lines or (len(line) >= 12 and line in sources) or \
                    (re.fullmatch(r"\w+", line) and re.search(rf"\b{line}\b", text)):
                found.append(f"exercise {number}: {line}")
    return found


# ---- nbgrader ------------------------------------------------------------------------------------------

def _nbgrader():
    # nbgrader runs `alembic` (its gradebook's migrations) from PATH: this Python's own scripts first.
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    # nbgrader 0.9 with SQLAlchemy 2 warns about its own session use on every autograde: not the teacher's business.
    warnings.filterwarnings("ignore", module=r"nbgrader\.")
    try:
        from nbgrader.converters import Autograde, GenerateAssignment, GenerateFeedback
        from nbgrader.coursedir import CourseDirectory
    except ImportError as exc:  # pragma: no cover - the message is the point
        raise ClassroomError("nbgrader is not installed in this Python: run `make setup` (requirements.txt, "
                             "'classroom' block)") from exc
    return CourseDirectory, GenerateAssignment, Autograde, GenerateFeedback


def _logger() -> logging.Logger:
    log = logging.getLogger("classroom.nbgrader")
    log.propagate = False   # nbgrader's expected warnings (a restored grade cell ...) go to the captured log only
    log.setLevel(logging.INFO)
    return log


def _config(build: Path):
    from traitlets.config.loader import PyFileConfigLoader
    return PyFileConfigLoader("nbgrader_config.py", path=str(build)).load_config()


def _run(app_class, build: Path, assignment: str, student: str | None = None, **attrs) -> str:
    """Run one nbgrader converter in this process; return its log, raise ClassroomError on failure."""
    from nbgrader.utils import capture_log
    CourseDirectory = _nbgrader()[0]
    config = _config(build)
    coursedir = CourseDirectory(config=config, root=str(build), log=_logger())
    coursedir.assignment_id = assignment
    if student is not None:
        coursedir.student_id = student
    app = app_class(coursedir=coursedir, config=config, log=_logger())
    for k, v in attrs.items():
        setattr(app, k, v)
    result = capture_log(app)
    if not result["success"]:
        raise ClassroomError(f"nbgrader {app_class.__name__} failed for {assignment}"
                             f"{f' / {student}' if student else ''}:\n{result.get('log', '')}\n{result.get('error', '')}")
    return result.get("log", "")


def write_config(build: Path) -> Path:
    build.mkdir(parents=True, exist_ok=True)
    path = build / "nbgrader_config.py"
    path.write_text(CONFIG.format(course_id=COURSE_ID, stub=CODE_STUB), encoding="utf-8")
    return path


def _kernel_note() -> str | None:
    """Warn when the notebooks' 'python3' kernel would not be this Python (grading needs lessons_lib)."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
    except Exception as exc:  # only a note
        return f"note: could not resolve the python3 kernel ({exc})"
    if argv0 in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}") or \
            Path(argv0).resolve() == Path(sys.executable).resolve():
        return None
    return (f"note: the 'python3' kernel runs {argv0}, not {sys.executable}; the notebooks will be graded with it "
            "(remove that user kernelspec, or install lessons_lib there)")


# ---- make classroom ------------------------------------------------------------------------------------

@dataclass
class Release:
    build: Path
    lessons: list[Lesson]       # as released: parsed from their copies in build/source/
    left_out: list[Lesson]
    seconds: float

    def notebook(self, lesson: Lesson) -> Path:
        return self.build / "release" / lesson.name / lesson.path.name


def release(paths: list[Path], build: Path = BUILD, partial: bool = False, echo=print) -> Release:
    """Build the student release of ``paths`` into ``build`` (see the module docstring)."""
    start = time.perf_counter()
    _, GenerateAssignment, _, _ = _nbgrader()
    lessons = [parse_lesson(p) for p in paths]
    bad = [x for x in lessons if not x.ok]
    if bad and not partial:
        raise ClassroomError("these lessons do not follow the exercise layout (tools/classroom.py docstring):\n"
                             + _problems(bad) + "\n(--partial builds the others)")
    good = [x for x in lessons if x.ok]
    if not good:
        raise ClassroomError("no lesson follows the exercise layout:\n" + _problems(bad))
    write_config(build)
    (build / "release").mkdir(parents=True, exist_ok=True)
    released = []
    for lesson in good:
        t0 = time.perf_counter()
        staged = build / "source" / lesson.name
        if staged.exists():
            shutil.rmtree(staged)
        staged.mkdir(parents=True)
        shutil.copy2(lesson.path, staged / lesson.path.name)
        for helper in lesson.path.parent.iterdir():
            if helper.suffix != ".ipynb" and not helper.name.startswith(".") and helper.name not in NOT_HELPERS:
                (shutil.copytree if helper.is_dir() else shutil.copy2)(helper, staged / helper.name)
        lesson = parse_lesson(staged / lesson.path.name)   # the copy nbgrader reads (the source may change meanwhile)
        if not lesson.ok:
            raise ClassroomError(f"{lesson.name} changed while it was copied:\n" + _problems([lesson]))
        _run(GenerateAssignment, build, lesson.name, force=True, create_assignment=True)
        out = build / "release" / lesson.name / lesson.path.name
        found = leaks(read_notebook(out), secret_lines(lesson.path))
        if found:
            shutil.rmtree(out.parent)
            raise ClassroomError(f"{lesson.name}: the student notebook still shows solution code, release removed:\n  "
                                 + "\n  ".join(found))
        released.append(lesson)
        echo(f"  {lesson.name}: {len(lesson.exercises)} exercises, "
             f"{sum(e.points for e in lesson.exercises):g} points ({time.perf_counter() - t0:.1f} s)")
    names = ", ".join(x.name for x in good)
    readme = STUDENT_README.format(lessons=names, first=good[0].name[:2], last=good[-1].name[:2])
    (build / "release" / "README.md").write_text(readme, encoding="utf-8")
    shutil.make_archive(str(build / "student-release"), "zip", build / "release")
    return Release(build, released, bad, time.perf_counter() - start)


def _problems(lessons: list[Lesson]) -> str:
    return "\n".join(f"  {x.name}:\n" + "\n".join(f"    - {p}" for p in x.problems) for x in lessons)


# ---- make grade -------------------------------------------------------------------------------------------

@dataclass
class Score:
    student: str
    lesson: str
    grade_id: str
    points: float
    max_points: float
    explanation: str


@dataclass
class Grading:
    build: Path
    scores: list[Score]
    graded: list[tuple[str, str]]
    unmatched: list[str]
    failed: list[tuple[str, str, str]]     # (student, lesson, why): nbgrader could not grade it
    seconds: float

    def of(self, student: str, lesson: str) -> dict[str, Score]:
        return {s.grade_id: s for s in self.scores if s.student == student and s.lesson == lesson}


def _assignments(build: Path) -> list[str]:
    if not (build / "gradebook.db").exists() or not (build / "source").is_dir():
        raise ClassroomError(f"no release in {build}: run `make classroom` first")
    return sorted(p.name for p in (build / "source").iterdir() if p.is_dir())


def collect(submissions: Path, build: Path, assignments: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Copy ``submissions/<student>/**/<lesson>.ipynb`` into nbgrader's ``build/submitted/<student>/<lesson>/``.

    A notebook matches a lesson by its name, or by its number when the name was changed
    (``03_masked_vs_varlen_attention (1).ipynb``). Returns the (student, lesson) pairs and the files matched to none.
    """
    target = build / "submitted"
    pairs, unmatched = [], []
    by_number: dict[str, list[str]] = {}
    for a in assignments:
        by_number.setdefault(a.split("_", 1)[0], []).append(a)
    for student_dir in sorted(p for p in submissions.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for nb in sorted(student_dir.rglob("*.ipynb")):
            if ".ipynb_checkpoints" in nb.parts:
                continue
            lesson = nb.stem if nb.stem in assignments else None
            if lesson is None:
                m = re.match(r"(\d+)", nb.stem)
                candidates = by_number.get(m.group(1), []) if m else []
                lesson = candidates[0] if len(candidates) == 1 else None
            if lesson is None:
                unmatched.append(str(nb))
                continue
            dest = target / student_dir.name / lesson / f"{lesson}.ipynb"
            if submissions.resolve() != target.resolve():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(nb, dest)
            pairs.append((student_dir.name, lesson))
    return sorted(set(pairs)), unmatched


def _grade_outputs(path: Path) -> dict[str, str]:
    """grade_id -> what the grade cell printed (the score line and the checker's first explanation), or its error."""
    out = {}
    for cell in read_notebook(path)["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if not meta.get("grade"):
            continue
        parts = []
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                parts.append(source({"source": o.get("text", "")}))
            elif o.get("output_type") == "error":
                parts.append(f"{o.get('ename')}: {o.get('evalue')}")
        out[meta.get("grade_id", "")] = "".join(parts).strip()
    return out


def grade(build: Path = BUILD, submissions: Path | None = None, echo=print) -> Grading:
    """Autograde every submission under ``submissions`` (default: ``build/submitted``) and write the tables."""
    start = time.perf_counter()
    _, _, Autograde, GenerateFeedback = _nbgrader()
    assignments = _assignments(build)
    write_config(build)
    note = _kernel_note()
    if note:
        echo(note)
    submissions = Path(submissions) if submissions else build / "submitted"
    if not submissions.is_dir():
        raise ClassroomError(f"no submissions folder {submissions} (one folder per student holding the notebooks)")
    pairs, unmatched = collect(submissions, build, assignments)
    if not pairs:
        raise ClassroomError(f"no submitted notebook in {submissions} matches a released lesson ({', '.join(assignments)})")
    from nbgrader.api import Gradebook
    scores: list[Score] = []
    failed: list[tuple[str, str, str]] = []
    for student, lesson in pairs:
        t0 = time.perf_counter()
        try:   # one broken submission (not JSON, cells deleted ...) must not stop the other 29
            _run(Autograde, build, lesson, student, force=True, create_student=True)
            _run(GenerateFeedback, build, lesson, student, force=True)
        except ClassroomError as exc:
            failed.append((student, lesson, str(exc)))
            echo(f"  {student:>12s} {lesson}: NOT GRADED, see below")
            continue
        said = _grade_outputs(build / "autograded" / student / lesson / f"{lesson}.ipynb")
        with Gradebook(f"sqlite:///{build / 'gradebook.db'}") as gb:
            nb = gb.find_submission_notebook(lesson, lesson, student)
            rows = [Score(student, lesson, g.name, float(g.score), float(g.max_score), said.get(g.name, ""))
                    for g in nb.grades]
        rows.sort(key=lambda s: s.grade_id)
        scores += rows
        _write_summary(build / "feedback" / student / lesson / f"{lesson}.txt", student, lesson, rows)
        echo(f"  {student:>12s} {lesson}: {sum(s.points for s in rows):g} / {sum(s.max_points for s in rows):g} "
             f"({time.perf_counter() - t0:.1f} s)")
    _write_tables(build, scores)
    return Grading(build, scores, pairs, unmatched, failed, time.perf_counter() - start)


def _write_summary(path: Path, student: str, lesson: str, rows: list[Score]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{lesson}, {student}: {sum(s.points for s in rows):g} of {sum(s.max_points for s in rows):g} points", ""]
    for s in rows:
        lines.append(f"{s.grade_id}: {s.points:g} of {s.max_points:g}")
        lines += [f"    {line}" for line in s.explanation.split("\n") if line.strip()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_tables(build: Path, scores: list[Score]) -> None:
    with open(build / "scores_by_exercise.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "lesson", "exercise", "points", "max_points", "explanation"])
        for s in sorted(scores, key=lambda s: (s.student, s.lesson, s.grade_id)):
            w.writerow([s.student, s.lesson, s.grade_id, f"{s.points:g}", f"{s.max_points:g}", s.explanation])
    columns = sorted({(s.lesson, s.grade_id) for s in scores})
    lessons = sorted({s.lesson for s in scores})
    with open(build / "scores.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", *[g for _, g in columns], *lessons, "total", "max_total"])
        for student in sorted({s.student for s in scores}):
            mine = {(s.lesson, s.grade_id): s for s in scores if s.student == student}
            per_lesson = [sum(s.points for (lesson, _), s in mine.items() if lesson == x) for x in lessons]
            w.writerow([student, *[f"{mine[c].points:g}" if c in mine else "" for c in columns],
                        *[f"{p:g}" for p in per_lesson], f"{sum(per_lesson):g}",
                        f"{sum(s.max_points for s in mine.values()):g}"])


# ---- fake submissions (tests, and a teacher's dry run) --------------------------------------------------

def answer_source(stub: str, code: str, name: str, answer_name: str) -> str:
    """The answer cell with the stub's function replaced by ``code`` (which defines ``name``, renamed to
    ``answer_name``); the checker call after the stub stays."""
    code = re.sub(rf"\b{re.escape(name)}\b", answer_name, code)
    lines = stub.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {answer_name}"))
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][:1] in (" ", "\t")):
        end += 1
    return "\n".join(lines[:start] + [code.strip(), ""] + lines[end:]).strip() + "\n"


def submission(release_nb: dict, lesson: Lesson, answers: dict[str, tuple[str, str]]) -> dict:
    """A copy of the student notebook with answers filled in: ``answers[grade_id] = (code, name defined)``."""
    nb = json.loads(json.dumps(release_nb))
    for e in lesson.exercises:
        if e.grade_id in answers:
            code, name = answers[e.grade_id]
            cell = nb["cells"][e.answer_index]
            cell["source"] = answer_source(source(cell), code, name, e.answer_name)
    return nb


def reference_answers(lesson: Lesson) -> dict[str, tuple[str, str]]:
    """Each reference function as an answer (without the reference cell's own ``assert L.check_...``: the
    answer cell runs the checker anyway)."""
    return {e.grade_id: ("\n".join(line for line in e.reference_code.split("\n")
                                   if not re.match(rf"assert\s+[\w.]*check_\w+\(\s*{e.reference_name}\s*\)", line)),
                         e.reference_name) for e in lesson.exercises}


# ---- command line ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="which lessons follow the exercise layout")
    p.add_argument("lessons", nargs="*")
    p = sub.add_parser("release", help="build the student release (make classroom)")
    p.add_argument("lessons", nargs="*")
    p.add_argument("--build", type=Path, default=BUILD)
    p.add_argument("--partial", action="store_true", help="build the lessons that follow the layout, list the others")
    p = sub.add_parser("grade", help="autograde a folder of submissions (make grade)")
    p.add_argument("submissions", nargs="?", type=Path)
    p.add_argument("--build", type=Path, default=BUILD)
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            lessons = [parse_lesson(p) for p in lessons_in(args.lessons)]
            for x in lessons:
                print(f"{'ok  ' if x.ok else 'NOT '} {x.name}: {len(x.exercises)} exercises"
                      + ("".join(f"\n       - {p}" for p in x.problems)))
            return 0 if all(x.ok for x in lessons) else 1
        if args.command == "release":
            r = release(lessons_in(args.lessons), args.build.resolve(), args.partial)
            print(f"student release of {len(r.lessons)} lessons in {r.build / 'release'} "
                  f"(and {r.build / 'student-release.zip'}) in {r.seconds:.1f} s")
            if r.left_out:
                print("left out (not in the exercise layout yet):\n" + _problems(r.left_out))
                return 1
            return 0
        g = grade(args.build.resolve(), args.submissions)
        students = len({s for s, _ in g.graded})
        print(f"graded {len(g.graded) - len(g.failed)} notebooks of {students} students in {g.seconds:.1f} s: "
              f"{g.build / 'scores.csv'}, {g.build / 'scores_by_exercise.csv'}, feedback in {g.build / 'feedback'}")
        for path in g.unmatched:
            print(f"  not a released lesson, skipped: {path}")
        for student, lesson, why in g.failed:
            print(f"error: {student} / {lesson} was not graded:\n{why}", file=sys.stderr)
        return 1 if g.failed else 0
    except ClassroomError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
