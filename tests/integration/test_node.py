"""A torchrun node as one peer: 2 gloo ranks training data-parallel inside the node, one
hivemind identity, averaging with a 1-process peer through the swarm."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.integration.conftest import FAST, PeerProcess, max_abs_diff


def torchrun(ranks: int):
    def wrap(argv: list[str]) -> list[str]:
        assert argv[1:3] == ["-m", "workbench"], argv
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            *argv[1:],
        ]

    return wrap


def test_a_two_rank_node_and_a_one_process_peer_average_together(tmp_path: Path):
    """The single peer also reads a JSONL file (one document per record) instead of the
    default text: what each peer trains on is its own business, θ is the swarm's."""
    from tests.hf_fixtures import make_jsonl_dataset

    jsonl = make_jsonl_dataset(tmp_path / "jsonl", files=1, records=400, field="body") / "part-0.jsonl"
    common = [*FAST, "--rounds", "3", "--min-peers", "2", "--run-id", "node"]
    peers = []
    try:
        node = PeerProcess(
            "node",
            ["start", *common, "--name", "node", "--run-dir", str(tmp_path / "node")],
            tmp_path,
            wrap=torchrun(2),
        )
        peers.append(node)
        single = PeerProcess(
            "single",
            ["join", node.address(), *common, "--name", "single", "--run-dir", str(tmp_path / "single")]
            + ["--data", str(jsonl), "--text-field", "body"],
            tmp_path,
        )
        peers.append(single)
        assert node.wait(180) == 0, node.stderr()[-3000:]
        assert single.wait(60) == 0, single.stderr()[-3000:]
    finally:
        for peer in peers:
            peer.kill()
    # Both end on the same global params, after rounds where both took part.
    assert max_abs_diff(node.global_params(), single.global_params()) <= 1e-5
    rounds = node.events("round")
    assert [r["outer_step"] for r in rounds] == [1, 2, 3]
    assert all(r["group_size"] == 2 for r in rounds), rounds
    # The node weighs in with both ranks' samples: 5 steps x 8 sequences x 2 ranks vs x 1.
    assert all(r["group_weights"] == [40.0, 80.0] for r in rounds), [r["group_weights"] for r in rounds]
    done = node.events("done")[0]
    assert done["node_ranks"] == 2
    assert done["node_max_param_diff"] == 0.0  # data-parallel inside the node: the ranks agree
    assert done["final_eval_loss"] < done["initial_eval_loss"]
    assert "part-0.jsonl (400 files" in single.stderr(), single.stderr()[-2000:]
    # One hivemind identity for the node: only rank 0 ever started a peer.
    assert len(single.events("started")) == 1 and len(node.events("started")) == 1
