"""``torchrun`` for ``datc-launch`` under FSDP2 (``python -m datc.commands.torchrun``, the same
arguments as ``python -m torch.distributed.run``): its failures said in one line, as DeepSpeed's
launcher says them, instead of torchrun's error block and traceback (exit 1).

- A rank that ended with a status of its own (a refusal, exit 2: the rank printed its one line)
  ends the launch with that status, quietly.
- A rank killed by a signal (``kill -9``, the out-of-memory killer) is one line naming it, and
  the launch exits 128 + the signal.
- A ``--master-port`` already in use (``EADDRINUSE``) is one line, exit 2.
"""

from __future__ import annotations

import os
import signal
import sys


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def main(argv: list[str] | None = None) -> int:
    import logging

    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # torchrun's agent logs each failure in many lines
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401  (its logger, quieted below)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code < 0:
            print(f"datc-launch: rank {rank} (pid {failure.pid}) was ended by {_signal_name(code)} (killed, or out of "
                  "memory), so the run's other processes were stopped: run the same command again to resume from its "
                  "last checkpoint", file=sys.stderr, flush=True)
            return 128 - code
        return code  # the rank said why in its own line
    except Exception as e:  # noqa: BLE001  torchrun's own start-up: the rendezvous store
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text:
            print(f"datc-launch: --master-port {args.master_port} is in use by another process (another launch on this "
                  "machine?); pass another --master-port, or wait for that launch to end", file=sys.stderr, flush=True)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
