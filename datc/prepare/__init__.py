"""The prepare step: a setting's assets made once and cached (``datc-prepare``, or the first run
of a setting): the word-level tokenizer, the testbed's warm-started policy and its reward model
trained on the policy's own samples (:mod:`datc.prepare.testbed`), or a real model's files
(:mod:`datc.prepare.assets`)."""
