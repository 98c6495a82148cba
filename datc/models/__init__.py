"""Models and their loading: the testbed's tiny models and real ones by path or hub name, LoRA,
chat formats, the run's model set and files out of a PyPI wheel."""
