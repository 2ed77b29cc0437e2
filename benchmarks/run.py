"""Run the benchmark suite from a source checkout: ``python benchmarks/run.py --help``."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cupy_rope._dev.benchmark import main  # noqa: E402

if __name__ == "__main__":
    main()
