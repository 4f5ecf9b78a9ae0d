"""DataLoader throughput against num_workers, and what persistent_workers saves per epoch.

    .venv/bin/python benchmarks/loader_throughput.py            # about 20 s on 2 cores
    .venv/bin/python benchmarks/loader_throughput.py --quick    # about 8 s

Lesson 03 makes both points in a notebook; this script measures them side by side in one run
and reports ratios, so that numbers from different machines compare. Samples come from
``kit.lessons.data.SlowDataset``: each takes ``--delay-ms`` to load, either waiting (a sleep, like
I/O) or computing (spinning on the CPU, like a Python-heavy transform).

1. Throughput (samples/s, worker start-up included) for each ``num_workers``, as a ratio to
   ``num_workers=0``. Waiting overlaps across workers beyond the core count; computing does
   not.
2. Epoch time with ``persistent_workers=True`` against ``False`` over several short epochs,
   with no start-up work and with ``--init-ms`` of work in ``worker_init_fn`` (opening files,
   loading an index): the time to the first batch of every epoch after the first is what
   persistence removes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

from torch.utils.data import DataLoader

from kit.lessons.data import SlowDataset, time_loader


def _sleep_init(seconds: float):
    def init(worker_id: int) -> None:
        time.sleep(seconds)

    return init


def throughput(workers: list[int], samples: int, delay_s: float, busy: bool,
               repeats: int) -> list[float]:
    """Median samples/s for each num_workers (each measured ``repeats`` times, interleaved)."""
    runs: dict[int, list[float]] = {k: [] for k in workers}
    for _ in range(repeats):
        for k in workers:  # interleaved, so a noisy neighbour hits every setting alike
            loader = DataLoader(SlowDataset(samples, delay_s, busy=busy), batch_size=8,
                                num_workers=k)
            runs[k].append(time_loader(loader).samples_per_s)
    return [statistics.median(runs[k]) for k in workers]


def persistence(epochs: int, workers: int, init_s: float,
                repeats: int) -> dict[bool, tuple[float, float]]:
    """``{persistent: (median seconds per epoch, median first-batch seconds after epoch 0)}``."""
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(repeats):
        for persistent in (False, True):
            loader = DataLoader(SlowDataset(32, 0.001), batch_size=8, num_workers=workers,
                                worker_init_fn=_sleep_init(init_s), persistent_workers=persistent)
            timing = time_loader(loader, epochs=epochs)
            runs[persistent].append((sum(timing.epoch_s) / epochs,
                                     statistics.mean(timing.first_batch_s[1:])))
    return {p: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
            for p, v in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="load time of one sample")
    parser.add_argument("--init-ms", type=float, default=200.0, help="worker_init_fn work")
    args = parser.parse_args()
    samples, repeats = (48, 1) if args.quick else (96, 3)
    workers = [0, 1, 2, 4]
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")  # > cores on purpose

    print(f"{os.cpu_count()} CPU cores; {samples} samples of {args.delay_ms:g} ms, batch 8, "
          f"median of {repeats}")
    print(f"{'num_workers':>12} " + " ".join(f"{k:>7}" for k in workers))
    for busy, label in ((False, "waiting"), (True, "computing")):
        speed = throughput(workers, samples, args.delay_ms / 1000, busy, repeats)
        print(f"{label:>12} " + " ".join(f"{s / speed[0]:6.2f}x" for s in speed)
              + f"   (0 workers: {speed[0]:.0f} samples/s)")

    print(f"\npersistent_workers over 4 epochs of 32 samples, 2 workers, median of {repeats}")
    for init_ms in (0.0, args.init_ms):
        res = persistence(4, 2, init_ms / 1000, repeats)
        (epoch_f, first_f), (epoch_t, first_t) = res[False], res[True]
        print(f"  worker_init_fn {init_ms:5.0f} ms: epoch time False/True = "
              f"{epoch_f / epoch_t:5.2f}x, first batch of later epochs False/True = "
              f"{first_f / first_t:6.1f}x  ({first_f * 1000:.0f} ms vs {first_t * 1000:.1f} ms)")


if __name__ == "__main__":
    main()
