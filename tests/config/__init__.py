"""The config schema: every config composes and validates, bad values name the field."""
