"""Credit analysis on fixed rollouts: every credit scheme's weights on the *same* sampled
responses, and the two commands built on them.

- :mod:`datc.analysis.inputs`: a session and one sampled batch with every input any scheme may
  declare. The only module here that calls the trainer's phases.
- :mod:`datc.analysis.schemes`: which schemes are analysed (every credit config and registered
  scheme, found, never listed by hand) and their outputs on one batch.
- :mod:`datc.analysis.heatmaps` (``datc-heatmaps``): token-credit heatmaps.
- :mod:`datc.analysis.credit_accuracy` (``datc-credit-accuracy``): credit accuracy against a
  testbed task's gold contributions.

This package sits above :mod:`datc.training.trainer`; nothing in the trainer, the session or the pure
:mod:`datc.credit` package imports it.
"""
