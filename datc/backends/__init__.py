"""Processes and parallelism: ranks and their collectives, DeepSpeed's config, the optimizer step
behind one interface, the micro-batch by memory, the memory plan (``datc-memory-plan``) and
``datc-launch``."""
