"""The producers of the committed figures in results/, one or more per folder, each run as
``python -m scripts.results.<name>`` from the repository root (the command each figure records):

- ``end_token_weights``: results/credit_breakdown/end_token.{json,md};
- ``engine_runs``: results/engines/ (in the environment that has vLLM);
- ``lora_table``: the tables of results/lora/README.md;
- ``numerics_fingerprint``: results/demo/numerics.json (``make demo-results``);
- ``paired_cost``: results/real_model/cost-*.{json,md};
- ``rollout_stats``: results/real_model/rollout_stats/.

The benchmarks of results/bench/ are in ``scripts.bench``, the GPU check of results/gpu/ in
``scripts.gpu_check``."""
