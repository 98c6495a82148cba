"""The package's shape: its import graph, and the tests' own imports."""
