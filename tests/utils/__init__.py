"""datc.utils: the kept heap memory."""
