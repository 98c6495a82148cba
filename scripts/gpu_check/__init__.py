"""The GPU check (``python -m scripts.gpu_check``; docs/gpu-check.md): ``check`` (the command: cases
in order, the deadline, the report), ``cases`` (what runs in each case's process), ``decode_bench``
(the decode loops' measurements, also used by ``python -m scripts.bench.decode``), ``projection``
(the projected paper-preset run) and ``kit`` (``python -m scripts.gpu_check.kit``: the wheels the GPU
machine lacks). Outside the package: nothing in ``datc`` imports it."""
