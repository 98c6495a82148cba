"""Prompt data: prompt files and datasets (``data.path``, the testbed's generated prompts) and the
check of where the prompts, policy and reward model come from. The prepare step that trains the
testbed's models is :mod:`datc.prepare`."""
