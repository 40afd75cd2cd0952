"""Writes the example notebooks (the .ipynb files are generated from this file: edit here).

    .venv/bin/python notebooks/build.py           # write them
    .venv/bin/python notebooks/build.py --check   # exit 1 if a committed notebook differs

Cell ids are the cells' positions, so that writing them again changes nothing unless a cell did.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent
KERNEL = {
    "kernelspec": {"display_name": "Python 3 (swarm workbench)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def parameters(source: str):
    cell = new_code_cell(source)
    cell.metadata["tags"] = ["parameters"]
    return cell


NOTEBOOKS = {
    "01_quickstart": [
        new_markdown_cell(
            "# Quickstart: DiLoCo vs data-parallel on a simulated swarm\n\n"
            "Four virtual peers in this process run the exact optimizer code real peers run. "
            "Data-parallel averages gradients after every step; DiLoCo averages pseudo-gradients "
            "every `INNER_STEPS` steps. Same data, same model, same number of steps: compare the "
            "loss and the bytes each peer sent."
        ),
        parameters("STEPS = 400        # inner steps per peer\nPEERS = 4\nINNER_STEPS = 50\nMODEL = \"tiny\""),
        new_code_cell(
            "from workbench import Experiment, compare\n\n"
            "dp = Experiment(backend=\"sim\", method=\"dp\", peers=PEERS, steps=STEPS, model=MODEL, name=\"data-parallel\")\n"
            "diloco = Experiment(backend=\"sim\", method=\"diloco\", inner_steps=INNER_STEPS, peers=PEERS, steps=STEPS,\n"
            "                    model=MODEL, name=f\"DiLoCo H={INNER_STEPS}\")\n"
            "diloco.run()  # returns at once: training runs in a background thread"
        ),
        new_markdown_cell("The live widget follows the run while it trains (peers, loss, bytes):"),
        new_code_cell("diloco.widget()"),
        new_code_cell("diloco.wait()\ndp.run().wait()"),
        new_code_cell(
            "import matplotlib.pyplot as plt\n\n"
            "fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))\n"
            "compare([dp, diloco], x=\"tokens\", ax=left)\n"
            "compare([dp, diloco], x=\"bytes\", ax=right)\n"
            "plt.show()"
        ),
        new_code_cell(
            "import pandas as pd\n\n"
            "final = pd.concat([e.history().tail(1) for e in (dp, diloco)])[[\"experiment\", \"step\", \"bytes_per_peer\", \"eval_loss\"]]\n"
            "final[\"bytes_per_peer\"] = final[\"bytes_per_peer\"].map(lambda b: f\"{b / 1e6:.1f} MB\")\n"
            "final"
        ),
    ],
    "02_optimizers": [
        new_markdown_cell(
            "# The optimizer family: quality per byte\n\n"
            "Every method of `optim/` on the same simulated swarm: data-parallel (the reference), "
            "FedAvg / local SGD, DiLoCo, DiLoCo with int8 pseudo-gradients, DiLoCo with its all-reduce "
            "overlapped with the next round (eager updates, the default with `overlap=True`, and the "
            "naive one-step delay, `eager=False`), SparseLoCo as published (top-k 128 of every 4096 "
            "entries, 2-bit values, error feedback decaying by 0.95, each entry averaged over the peers "
            "that kept it) and streaming DiLoCo. Every "
            "`Experiment` takes the same optimizer options as `workbench start` and `workbench "
            "simulate`. See `docs/optimizers.md` for the full benchmark at H=50."
        ),
        parameters("STEPS = 400\nPEERS = 4\nINNER_STEPS = 50\nMODEL = \"tiny\""),
        new_code_cell(
            "from workbench import Experiment, compare\n\n"
            "common = dict(backend=\"sim\", peers=PEERS, steps=STEPS, model=MODEL)\n"
            "runs = [\n"
            "    Experiment(method=\"dp\", name=\"data-parallel\", **common),\n"
            "    Experiment(method=\"local_sgd\", inner_steps=INNER_STEPS, name=\"FedAvg\", **common),\n"
            "    Experiment(method=\"diloco\", inner_steps=INNER_STEPS, name=\"DiLoCo\", **common),\n"
            "    Experiment(method=\"diloco\", inner_steps=INNER_STEPS, update_codec=\"int8\", name=\"DiLoCo int8\", **common),\n"
            "    Experiment(method=\"diloco\", inner_steps=INNER_STEPS, overlap=True, name=\"DiLoCo eager overlap\", **common),\n"
            "    Experiment(method=\"diloco\", inner_steps=INNER_STEPS, overlap=True, eager=False, name=\"DiLoCo naive delay\", **common),\n"
            "    Experiment(method=\"sparseloco\", inner_steps=INNER_STEPS, name=\"SparseLoCo\", **common),\n"
            "    Experiment(method=\"streaming\", inner_steps=INNER_STEPS, fragments=2, name=\"streaming F=2\", **common),\n"
            "]\n"
            "for run in runs:  # one after the other: they would share the same CPU cores anyway\n"
            "    run.run().wait()\n"
            "    print(f\"{run.name:>20}: eval loss {run.history().eval_loss.iloc[-1]:.3f}\")"
        ),
        new_code_cell("compare(runs, x=\"bytes\");"),
        new_code_cell(
            "import pandas as pd\n\n"
            "rows = []\n"
            "for run in runs:\n"
            "    last = run.history().iloc[-1]\n"
            "    rows.append({\"method\": run.name, \"eval loss\": round(last.eval_loss, 3), \"MB per peer\": round(last.bytes_per_peer / 1e6, 2)})\n"
            "pd.DataFrame(rows).set_index(\"method\")"
        ),
    ],
    "03_real_swarm": [
        new_markdown_cell(
            "# A real swarm: start local peers, watch and steer them live\n\n"
            "`backend=\"local\"` starts real hivemind peers as processes on 127.0.0.1 (what "
            "`workbench demo` runs). This notebook owns the run, so the widget can steer it: pause "
            "a peer, or change the outer learning rate and H for every peer at once."
        ),
        parameters("PEERS = 3\nROUNDS = 20\nINNER_STEPS = 20\nMODEL = \"tiny\""),
        new_code_cell(
            "from workbench import Experiment\n\n"
            "run = Experiment(backend=\"local\", peers=PEERS, rounds=ROUNDS, inner_steps=INNER_STEPS, model=MODEL, threads=1)\n"
            "run.run()\n"
            "widget = run.widget()\n"
            "widget"
        ),
        new_markdown_cell(
            "Steer from Python exactly as the widget's *steer* button does. Every peer applies the "
            "change at the same outer step and echoes the version in its heartbeat:"
        ),
        new_code_cell(
            "import time\n\n"
            "# a round in, while the run has rounds left (this cell waited for good on ROUNDS = 1)\n"
            "deadline = time.time() + 300\n"
            "while run.running and time.time() < deadline and (widget.last is None or widget.last.outer_round < min(2, ROUNDS - 1)):\n"
            "    time.sleep(0.5); widget.refresh()\n"
            "print(widget.steer(outer_lr=0.5) if run.running else f\"the run ended: {run!r}\")"
        ),
        new_code_cell(
            "deadline = time.time() + 120\n"
            "while True:\n"
            "    widget.refresh()\n"
            "    applied, total = widget.last.applied()\n"
            "    if (total and applied == total) or not run.running or time.time() > deadline:\n"
            "        break\n"
            "    time.sleep(1)\n"
            "control = widget.last.control\n"
            "print(f\"{applied}/{total} peers applied control v{control.version}\" if control else \"nothing was steered\")"
        ),
        new_code_cell("run.wait()\nrun.history().tail()"),
    ],
    "04_replay": [
        new_markdown_cell(
            "# Replay a recorded run\n\n"
            "`workbench status ADDR --watch 1 --record run.jsonl` (or `workbench monitor --record`) "
            "keeps every reading of a run. Replaying feeds them through the same monitor, so you "
            "get the same snapshots, events and history. `data/sample_run.jsonl` is a 3-peer run "
            "recorded on this project's machine."
        ),
        parameters("RECORDING = \"data/sample_run.jsonl\""),
        new_code_cell(
            "from swarm.monitor import replay\n\n"
            "snapshots = list(replay(RECORDING))\n"
            "last = snapshots[-1]\n"
            "print(f\"{len(snapshots)} readings, run '{last.run_id}', up to round {last.outer_round}\")\n"
            "for event in last.events[:12]:\n"
            "    print(f\"{event.kind:>8}  {event.message}\")"
        ),
        new_code_cell(
            "import matplotlib.pyplot as plt\n\n"
            "fig, ax = plt.subplots(figsize=(7, 3.5))\n"
            "start = snapshots[0].time\n"
            "for peer_id, metrics in last.history.items():\n"
            "    points = metrics.get(\"loss\", [])\n"
            "    ax.plot([t - start for t, _ in points], [v for _, v in points], label=peer_id[-8:])\n"
            "ax.set_xlabel(\"seconds\"); ax.set_ylabel(\"inner loss\"); ax.legend(); plt.show()"
        ),
        new_markdown_cell("The live widget works on a recording too (one reading per half second):"),
        new_code_cell(
            "from workbench.sources import ReplaySource\nfrom workbench.notebook.widget import SwarmWidget\n\n"
            "SwarmWidget(ReplaySource(RECORDING, interval=0.5))"
        ),
    ],
}


def build(name: str) -> str:
    """The text of notebook ``name`` as this file makes it."""
    notebook = new_notebook(cells=NOTEBOOKS[name], metadata=KERNEL)
    for index, cell in enumerate(notebook.cells):
        cell.id = f"cell-{index:02d}"
    nbformat.validate(notebook)
    return nbformat.writes(notebook) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a notebook differs")
    args = parser.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path, text = HERE / f"{name}.ipynb", build(name)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
            continue
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.name}")
    if stale:
        print(f"{', '.join(stale)} differ from notebooks/build.py: edit build.py, then run it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
