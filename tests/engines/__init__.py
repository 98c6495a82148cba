"""The rollout engines: sampling, lean and static decode, vLLM (datc.engines)."""
