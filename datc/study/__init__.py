"""``datc-study``: METHOD §6's tuned comparison as a command of the package, the running half
(protocol, bracketing search, matched-KL search, jobs dispatched by Hydra's launchers) and the
reading half (:mod:`datc.study.reading`, :mod:`datc.study.matched`, :mod:`datc.study.tables`, which
``datc-compare --tuned`` writes its tables with) in one room, above ``datc-train``'s floor."""
