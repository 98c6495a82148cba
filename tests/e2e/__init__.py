"""Whole runs: training end to end, reliability (kill, resume, faults), 2-process DeepSpeed and FSDP2 runs, the docs build, the install, the command line's help."""
