"""One rank of ``tests/e2e/test_distributed.py::test_the_collectives_over_two_gloo_ranks``: each
``Dist`` collective over two gloo processes, written to ``<out>/rank<r>.json``."""

import json
import sys

import torch

from datc.backends.distributed import Dist

if __name__ == "__main__":
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    d = Dist(rank=rank, world_size=2, local_rank=rank, enabled=True)
    res = {
        "sum": d.sum(1.5 + rank),
        "max": d.max([0.25, -3.0][rank]),
        "max_negative": d.max([-7.0, -2.0][rank]),
        "tensor_sum": d.tensor_sum(torch.tensor([1.0, 2.0]) * (rank + 1)).tolist(),
        "cat": d.tensor_cat(torch.arange(rank + 1, dtype=torch.float32) + 10 * rank).tolist(),
        "gather": d.gather({"rank": rank}),
        "broadcast": d.broadcast(f"from {rank}"),
        "shard": [d.shard(8).start, d.shard(8).stop],
    }
    d.close()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(res, f)
