"""``python -m benchmarks`` (from the repository root): see :mod:`benchmarks`."""

import os

# one thread per process, set before torch is imported (the forked ranks inherit it)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.cli import main

raise SystemExit(main())
