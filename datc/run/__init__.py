"""A run's files: its directory, lock, checkpoints, input fingerprints, names, logging, signals,
and the provenance every results file records. No model code beyond what a checkpoint loads;
exports are ``datc-export``'s (:mod:`datc.commands.export`)."""
