"""Memory by formula, before a run: the bytes each item and phase of a step holds per process
(:mod:`datc.memory.formulas`), the plan of a composed config (``datc-memory-plan``,
:mod:`datc.memory.plan`, reading the step plan's own decisions) and the micro-batch sized by
memory (``trainer.micro_batch_size=auto``, :mod:`datc.memory.micro_batch`)."""
