"""A run's files: its directory, lock, checkpoints, input fingerprints, names, logging, signals and
exports, and the provenance every results file records. No model code beyond what a checkpoint or
an export loads."""
