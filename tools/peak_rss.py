#!/usr/bin/env python3
"""Run a command and print its peak RSS in MiB and wall seconds on the last line of stderr: `peak_rss MiB seconds`.

Why a separate process: Linux keeps a process's RSS high-water mark across exec, and a child forked from a large
parent (a test runner, a benchmark that generated data) starts with the parent's pages counted. Started from this
small process, the figure is the command's own. Exit status is the command's.

Example: python tools/peak_rss.py ikquant in.gguf out.gguf --type q8_0
"""

import os
import subprocess
import sys
import time

t0 = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(proc.pid, 0)
print(f"peak_rss {usage.ru_maxrss / 1024:.1f} {time.perf_counter() - t0:.3f}", file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
