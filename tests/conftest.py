"""Suite-wide settings, applied before any test imports minisgl."""

import os

# The engine's thread count follows other processes' load (engine/cpu_threads.py). The suite
# runs servers, HF and engines side by side, so it keeps the count fixed for results that repeat
# bit for bit; tests/test_cpu_threads.py turns it on where it is the subject.
os.environ.setdefault("MINISGL_ADAPTIVE_THREADS", "0")
