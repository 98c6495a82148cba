"""The documentation site's generators: references built from the code at ``make docs`` time."""
