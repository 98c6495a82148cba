"""The tools of scripts/: the TRL comparison, the GPU check, the tuned sweep."""
