"""A run's files: names, provenance, W&B logging, fingerprints of the files a run loads."""
