"""Forwards over a sampled batch: the policy's no-grad passes, shared-prompt forwards, the shared
frozen trunk, and the reward model's attribution inputs."""
