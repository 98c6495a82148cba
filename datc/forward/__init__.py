"""Forwards over a sampled batch: the policy's no-grad passes, the shared frozen trunk, and the
reward model's attribution inputs (the shared-prompt forward they build on is
:mod:`datc.models.shared_prompt`)."""
