"""hivemind's DHT and averager are forked processes: forked after the model or after DiLoCo's copy
of θ, they keep those pages, as they were, for the rest of the run (docs/performance.md, "A peer's
memory"). So a peer connects after loading its data and before building its model, and its
averager starts before DiLoCo copies θ. Checked here on the order of the calls, without hivemind."""

from __future__ import annotations

import types

import pytest
import torch

import workbench.run.peer as peer_module
from optim.diloco import DiLoCo
from workbench.cli.command import build_config, build_parser
from workbench.run.outer import build_outer


class Stop(Exception):
    pass


def config(*flags: str):
    return build_config(build_parser().parse_args(["start", "--model", "tiny", *flags]))


def test_the_dht_starts_after_the_data_and_before_the_model(monkeypatch, tmp_path):
    calls: list[str] = []
    load_data = peer_module.load_data

    def data(cfg):
        calls.append("data")
        return load_data(cfg)

    def connect(network, keys):
        calls.append("dht")
        return types.SimpleNamespace(dht=None, board=None, store=None, peer_id="QmPeer")

    def model(cfg, device, corpus):
        calls.append("model")
        raise Stop

    monkeypatch.setattr(peer_module, "load_data", data)
    monkeypatch.setattr(peer_module, "connect", connect)
    monkeypatch.setattr(peer_module, "build_model_and_optimizer", model)
    with pytest.raises(Stop):
        peer_module.Peer(config("--run-dir", str(tmp_path / "run"))).setup()
    assert calls == ["data", "dht", "model"]


@pytest.mark.parametrize("flags", [(), ("--method", "sparseloco")])  # sparseloco: kept-masks too
def test_the_averager_starts_before_diloco_copies_theta(monkeypatch, flags):
    calls: list[str] = []
    save = DiLoCo.save_global_params

    def save_global_params(self):
        calls.append("theta")
        save(self)

    class Averager:
        def __init__(self, dht, *, tensors_like, state_provider, masks, **common):
            calls.append("averager")
            self.shapes, self.masks, self.state_provider = (
                [t.shape for t in tensors_like],
                masks,
                state_provider,
            )

    monkeypatch.setattr(DiLoCo, "save_global_params", save_global_params)
    monkeypatch.setattr("swarm.averaging.SwarmAverager", Averager)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = build_outer(
        config(*flags), model, inner, dht=None, keys=None, board=None, beat=lambda stage: None
    )
    assert calls[:2] == ["averager", "theta"]
    shapes = [p.shape for p in model.parameters()]
    kept = bool(flags)
    assert (
        outer.averager.shapes == (shapes * 2 if kept else shapes)
        and outer.averager.masks == len(shapes) * kept
    )
    assert outer.averager.state_provider().outer_step == 0  # the state served is DiLoCo's
