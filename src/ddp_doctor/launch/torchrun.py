"""`python -m ddp_doctor.launch.torchrun ARGS_JSON`: PyTorch's own launcher, run on a parsed torchrun namespace.

The `check` parent parses the command line with torchrun's own parser (so every rendezvous flag works as it does
for torchrun) and hands the namespace over as JSON. A worker failure is the doctor's to report: torchrun's
`ChildFailedError` dump would only repeat it, so it becomes a plain exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    # torchrun logs every SIGTERM it sends to a worker at WARNING; the doctor's report says what happened.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    try:
        run(argparse.Namespace(**json.loads(sys.argv[1])))
    except ChildFailedError:
        sys.exit(1)


if __name__ == "__main__":
    main()
