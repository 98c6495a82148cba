"""One module per registered credit scheme; every module here is imported by datc.credit."""
