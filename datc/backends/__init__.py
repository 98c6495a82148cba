"""Processes and parallelism: ranks and their collectives, DeepSpeed's config, the optimizer step
behind one interface, one plug-in per backend (plain, DeepSpeed, FSDP2). The memory plan and the
micro-batch by memory are :mod:`datc.memory`; ``datc-launch`` is :mod:`datc.commands.launch`."""
