"""datc-compare: tables, tuning and the matched-KL control (datc.report)."""
