"""What an elastic restart costs: torchrun with a worker killed mid-run against an uninterrupted
run.

    .venv/bin/python benchmarks/torchrun_restart.py             # about 1 minute on 2 cores
    .venv/bin/python benchmarks/torchrun_restart.py --repeats 1

Lesson 02 kills a worker and lets ``torchrun --max-restarts=1`` resume from a checkpoint. This
script runs the same tiny job (2 workers, a few all-reduces per step) through kit.torchrun,
alternating a clean run and a run whose rank 1 is SIGKILLed halfway on the first attempt, and
reports wall times and their ratio measured side by side. The difference is what a failure
costs beyond the lost steps: the agent noticing, stopping the survivors, a new rendezvous and
a fresh start of every worker (Python and torch imported again).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kit.torchrun import init_process_group_per_attempt, torchrun, write_script

JOB = """
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
crash = os.environ.get("CRASH") == "1" and attempt == "0"
init_process_group_per_attempt("gloo")
for step in range(20):
    if crash and dist.get_rank() == 1 and step == 10:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1000)
    dist.all_reduce(t)
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = write_script(Path(tmp) / "job.py", "import os\nimport signal\nimport torch\n"
                              "import torch.distributed as dist\n",
                              init_process_group_per_attempt, JOB)
        times: dict[str, list[float]] = {"clean": [], "killed and restarted": []}
        for _ in range(args.repeats):
            for kind, crash in (("clean", "0"), ("killed and restarted", "1")):
                start = time.perf_counter()
                torchrun(script, nproc_per_node=2, max_restarts=1, env={"CRASH": crash}, echo=False,
                         timeout=300)
                times[kind].append(time.perf_counter() - start)
    clean, restarted = (statistics.median(times[k]) for k in times)
    print(f"{'run':<24}{'median wall s':>14}   all runs")
    for kind, values in times.items():
        print(f"{kind:<24}{statistics.median(values):>14.2f}   "
              + " ".join(f"{v:.2f}" for v in values))
    print(f"restart / clean: {restarted / clean:.2f}x  (a restart adds {restarted - clean:.1f} s)")


if __name__ == "__main__":
    main()
