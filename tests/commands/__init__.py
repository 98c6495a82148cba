"""datc-export (datc.commands)."""
