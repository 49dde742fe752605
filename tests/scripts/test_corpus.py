"""The benchmarks' shared helpers (`scripts/corpus.py`)."""

import os
import sys

from scripts.corpus import run_measured


def test_a_process_trees_cpu_counts_its_children():
    # the child spends ~0.4 s of CPU in a grandchild of its own, then exits 3
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import time; t = time.process_time()\\nwhile time.process_time() - t < 0.4: pass']); sys.exit(3)")
    returncode, err, wall, cpu = run_measured([sys.executable, "-c", code], os.getcwd(), dict(os.environ))
    assert returncode == 3 and err == b""
    assert 0.3 < cpu <= wall + 0.5
