# The two commands of the README:
#   make course   set up, then open the course in JupyterLab
#   make test     set up, then lint (ruff) and run every test (unit tests, notebooks under nbval, browser)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup course test unit notebooks figures bench site clean

setup:
	./tools/setup.sh

# JupyterLab refuses to run as root unless told; containers and CI machines often are root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

course: setup
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 $(ALLOW_ROOT) notebooks/

# make test runs the tests in TEST_WORKERS processes (pytest-xdist), one test file per process at a time, so a
# file's shared fixtures (the classroom's grading, the browser's JupyterLab) are built once; the files that run whole
# lessons go first (tests/conftest.py), each worker on its share of the cores. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

unit: setup
	$(PY) -m pytest tests

notebooks: setup
	$(PY) -m pytest notebooks

figures: setup
	$(PY) -m lessons_lib.course.figures

bench: setup
	$(PY) -m lessons_lib.measure.bench

site: setup
	$(PY) tools/build_site.py

clean:
	rm -rf site test-artifacts .pytest_cache

# The classroom (docs/teaching.md): a student release without solutions, and autograding, with nbgrader.
#   make classroom                       student release of every lesson -> $(CLASSROOM)/release/
#   make grade SUBMISSIONS=dir           autograde dir/<student>/<lesson>.ipynb -> $(CLASSROOM)/scores.csv, feedback/
CLASSROOM ?= build/classroom
SUBMISSIONS ?=
CLASSROOM_FLAGS ?=

.PHONY: classroom grade

classroom: setup
	$(PY) tools/classroom.py release --build $(CLASSROOM) $(CLASSROOM_FLAGS)

grade: setup
	$(PY) tools/classroom.py grade --build $(CLASSROOM) $(SUBMISSIONS)

# Which claim rows each of the engine's named faults flips (tools/claims_coverage.py; not part of make test):
#   make claims-coverage                          each fault against the lessons that declare it
#   make claims-coverage COVERAGE_FLAGS="--all --jobs 2 --lessons 03,05"
COVERAGE_FLAGS ?=

.PHONY: claims-coverage

claims-coverage: setup
	$(PY) tools/claims_coverage.py $(COVERAGE_FLAGS)
