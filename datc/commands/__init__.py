"""The package's commands that sit on every room below them: ``datc-prepare`` (fill the cache),
``datc-export`` (a run's checkpoint as a Hugging Face model) and ``datc-launch`` (one run over
several processes). ``datc-train`` (:mod:`datc.train`), ``datc-compare`` (:mod:`datc.compare`) and
the analysis commands (:mod:`datc.analysis`) live with what they run."""
