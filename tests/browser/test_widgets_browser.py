"""End to end: every lesson's explorer moves in a real browser and shows what lessons_lib computes.

For each lesson with an explorer this opens the notebook in JupyterLab (Debian's Chromium, headless),
waits for a really connected kernel, runs all cells, reads the live numbers off the widget, moves
its controls with the keyboard (or types into them), and checks that the numbers become exactly
what a direct call of ``lessons_lib`` gives for the new input and that the figure was redrawn.
Screenshots before/after go to ``test-artifacts/browser/``.

The update latency (key press -> new figure decoded and painted) is measured in the page for
several moves and printed; never asserted (timings vary by machine).

Each lesson's test is in ``explore_lNN.py``; they are collected here so that all of them share
one JupyterLab server and one Chromium (module-scoped fixtures in ``conftest.py``).
"""
from explore_l00 import test_lesson00_comm_cost_explorer  # noqa: F401
from explore_l01 import test_lesson01_flat_batch_explorer  # noqa: F401
from explore_l02 import test_lesson02_module_reach_explorer  # noqa: F401
from explore_l03 import test_lesson03_attention_run_explorer  # noqa: F401
from explore_l04 import test_lesson04_tp_packing_explorer  # noqa: F401
from explore_l05 import test_lesson05_roofline_explorer  # noqa: F401
from explore_l06 import test_lesson06_prefill_plan_explorer  # noqa: F401
from explore_l07 import test_lesson07_kernel_explorer  # noqa: F401
from explore_l08 import test_lesson08_chunked_prefill_explorer  # noqa: F401
