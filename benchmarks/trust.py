"""What the direct plane's protections cost: sketches of each update, per size.

    python -m benchmarks.trust [--mb 1 --mb 10 --mb 100]

Each round over the direct plane computes two sketches (swarm.sketch): one of the update this
peer sends (with R drawn for the round and the update's length), one of the sum it gets back.
Measured here on one thread (as the all-reduce benchmark's members run), as a ratio to copying
the same tensor once (a memory-bound baseline measured in the same run). The rendezvous board
costs one round trip over hivemind per new ring and the sketch exchange one per round,
overlapped with the ring; both show in benchmarks.allreduce's direct rows. Writes benchmarks/results/trust.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _median_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    import torch

    from swarm.sketch import Sketcher

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, action="append", help="update sizes in MB (default: 1, 10, 100)")
    parser.add_argument("--out", type=Path, default=RESULTS / "trust.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for mb in args.mb or [1.0, 10.0, 100.0]:
        update = torch.randn(int(mb * 1e6) // 4)
        target = torch.empty_like(update)
        copy_ms = _median_ms(lambda u=update, t=target: t.copy_(u))
        # As the plane does it: R drawn once per round, the update's rows and |x|^2, the sum's rows.
        own_ms = _median_ms(
            lambda u=update: (Sketcher(b"seed", u.numel(), fast=True).rows(u), torch.dot(u, u))
        )
        sketcher = Sketcher(b"seed", update.numel(), fast=True)
        result_ms = _median_ms(lambda u=update, s=sketcher: s.rows(u))
        rows.append(
            dict(mb=mb, copy_ms=copy_ms, own_sketch_ms=own_ms, result_sketch_ms=result_ms,
                 ratio_to_copy=(own_ms + result_ms) / copy_ms)
        )  # fmt: skip
        print(f"{mb:6g} MB  copy {copy_ms:7.2f} ms  sketches {own_ms + result_ms:7.2f} ms  "
              f"({rows[-1]['ratio_to_copy']:.1f}x a copy)")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "threads": 1}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
