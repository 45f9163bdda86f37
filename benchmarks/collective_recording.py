"""Cost of recording the script's own collectives during observed steps (issue: at most 2% of an observed step).

Run under torchrun (``python -m benchmarks collective_recording`` does that). One DDP model with the clean
example's architecture is observed by a doctor; each step is what a typical loop does: forward, backward,
optimizer step, and one logging ``all_reduce`` of the loss. Every round times one step with the doctor's collective
recording on (per call: a frame walk for the user's line, a CRC32 of the call's signature, a log entry) and one with
it off (the wrappers still installed, the listener removed), in rotating order. Reports the median per-round ratio.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _shared import interleave, parser, ratio, write
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import observe
from ddp_doctor.observation import collectives


def main() -> None:
    args = parser(rounds=400).parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)

    def step() -> None:
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        logged = loss.detach().reshape(1)
        dist.all_reduce(logged)  # the loop's logging collective

    doctor = observe(ddp, optimizer=opt)
    doctor.start()
    listeners = doctor._listeners
    listeners._stops.pop()()  # stop the doctor's own collectives listener (registered last); toggled below
    listening: dict = {"remove": None}

    def recording() -> None:
        if listening["remove"] is None:
            listening["remove"] = collectives.listen(listeners.on_collective)
        step()

    def not_recording() -> None:
        if listening["remove"] is not None:
            listening["remove"]()
            listening["remove"] = None
        step()

    for _ in range(10):
        step()  # warm-up
    times = interleave({"recording": recording, "not recording": not_recording}, args.rounds)
    # The listener's own cost, timed directly on a real call (the interleaved ratio above is at the mercy of
    # the machine's noise at a few milliseconds per step): median of 20 batches of 200 calls.
    listening["remove"] = listening["remove"] or collectives.listen(listeners.on_collective)
    seen: list[collectives.Call] = []
    grab = collectives.listen(seen.append)
    dist.all_reduce(torch.zeros(1))
    grab()
    per_call = []
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(200):
            listeners.on_collective(seen[0])
        per_call.append((time.perf_counter() - t0) / 200)
    doctor.stop()
    recorded = doctor.record().counter("collectives").sum().item()
    result = {
        "param_tensors": sum(1 for _ in ddp.parameters()),
        "rounds": args.rounds,
        "collectives_recorded": int(recorded),
        "collective recording": ratio(
            times["recording"], times["not recording"], vs="the same observed step, recording off", goal="at most 1.02x"
        ),
        "step_ms": round(1e3 * statistics.median(times["not recording"]), 3),
        "listener_us_per_call": round(1e6 * statistics.median(per_call), 1),
    }
    result["listener_share_of_step"] = round(result["listener_us_per_call"] / (1e3 * result["step_ms"]), 5)
    write(result, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
