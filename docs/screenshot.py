"""Regenerate docs/images/monitor.svg: the monitor over a real 4-peer demo swarm.

    .venv/bin/python docs/screenshot.py [--seconds 90]

Starts 4 local peers (tiny model) exactly as `workbench demo` does, opens the app headless,
lets the run go for a while, and saves the app's own SVG screenshot.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import replace
from pathlib import Path

from tui.app import SwarmApp
from workbench.config import RunConfig
from workbench.local.launch import LocalSwarm
from workbench.run.model import preset
from workbench.sources import DemoSource


async def main(seconds: float, out: Path) -> None:
    base = RunConfig()
    config = replace(
        base,
        model=preset("tiny"),
        diloco=replace(base.diloco, inner_steps=20),
        train=replace(base.train, threads=1),
        peer=replace(base.peer, run_id="demo-screenshot", rounds=200, min_peers=4),
    )
    run_dir = Path(tempfile.mkdtemp(prefix="workbench-screenshot-"))
    swarm = LocalSwarm(config, peers=4, run_dir=run_dir)
    swarm.start()
    try:
        source = DemoSource.of(swarm)
        app = SwarmApp(source, clock=False)
        async with app.run_test(size=(150, 42)) as pilot:
            await pilot.pause(seconds)
            app.save_screenshot(str(out.name), str(out.parent))
        source.close()
    finally:
        swarm.stop()
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "images" / "monitor.svg")
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.out))
