"""The GPU check's code (``scripts/gpu_check.py``): its cases, the decode benchmark, the projection and
the chat formats its cases and the tests use. Outside the package: nothing in ``datc`` imports it."""
