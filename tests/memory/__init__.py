"""The memory plan and the micro-batch by memory (datc.memory)."""
