"""The analysis commands: credit breakdown and heatmaps (datc.analysis)."""
