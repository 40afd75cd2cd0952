"""hivemind's DHT and averager are forked processes: forked after the model or after DiLoCo's copy
of θ, they keep those pages, as they were, for the rest of the run (docs/performance.md, "A peer's
memory"). So a peer connects after loading its data, starts its averagers on the model's meta
shapes, and only then builds its model. Checked here on the order of the calls, without hivemind."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import workbench.run.peer as peer_module
from optim.diloco import DiLoCo
from workbench.cli.command import build_config, build_parser
from workbench.run.outer import build_outer, start_averagers
from workbench.run.training import build_model_and_optimizer, load_data, trained_shapes


class Stop(Exception):
    pass


def config(*flags: str, model: str = "tiny"):
    return build_config(build_parser().parse_args(["start", "--model", model, *flags]))


def test_the_dht_and_the_averagers_start_before_the_model(monkeypatch, tmp_path):
    calls: list[str] = []
    shapes_seen: list = []

    def data(cfg):
        calls.append("data")
        return load_data(cfg)

    def connect(network, keys):
        calls.append("dht")
        return types.SimpleNamespace(dht=None, board=None, store=None, peer_id="QmPeer")

    def averagers(cfg, shapes, **swarm):
        calls.append("averagers")
        shapes_seen.extend(shapes)
        return types.SimpleNamespace(averagers=[])

    def model(cfg, device, corpus):
        calls.append("model")
        raise Stop

    monkeypatch.setattr(peer_module, "load_data", data)
    monkeypatch.setattr(peer_module, "connect", connect)
    monkeypatch.setattr(peer_module, "start_averagers", averagers)
    monkeypatch.setattr(peer_module, "build_model_and_optimizer", model)
    cfg = config("--run-dir", str(tmp_path / "run"))
    with pytest.raises(Stop):
        peer_module.Peer(cfg).setup()
    assert calls == ["data", "dht", "averagers", "model"]
    # The averagers were made like the model's trained parameters, from shapes with no memory.
    device, corpus, _ = load_data(cfg)
    real, _ = build_model_and_optimizer(cfg, device, corpus)
    assert all(s.is_meta for s in shapes_seen)
    assert [s.shape for s in shapes_seen] == [p.shape for p in real.parameters() if p.requires_grad]


def test_a_hugging_face_models_shapes_come_without_reading_its_weights(tmp_path: Path, monkeypatch):
    pytest.importorskip("transformers")
    import transformers

    from tests.hf_fixtures import make_llama

    directory = make_llama(tmp_path / "llama", weights=True)
    cfg = config("--block-size", "32", model=str(directory))
    device, corpus, _ = load_data(cfg)
    real, _ = build_model_and_optimizer(cfg, device, corpus)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read for the shapes")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    shapes = trained_shapes(cfg, corpus)
    assert all(s.is_meta for s in shapes)
    assert [s.shape for s in shapes] == [p.shape for p in real.parameters() if p.requires_grad]


class FakeAverager:
    def __init__(self, calls, dht, *, tensors_like, state_provider, masks=0, **common):
        calls.append("averager")
        self.calls = calls
        self.shapes, self.masks, self.state_provider = [t.shape for t in tensors_like], masks, state_provider
        self.serving = False

    def start_serving(self):
        self.calls.append("serving")
        self.serving = True

    def set_state_priority(self, outer_step):
        self.priority = outer_step


@pytest.mark.parametrize("flags", [(), ("--method", "sparseloco")])  # sparseloco: kept-masks too
def test_the_averager_starts_before_diloco_copies_theta_and_serves_after(monkeypatch, flags):
    calls: list[str] = []
    save = DiLoCo.save_global_params

    def save_global_params(self):
        calls.append("theta")
        save(self)

    monkeypatch.setattr(DiLoCo, "save_global_params", save_global_params)
    monkeypatch.setattr("swarm.averaging.SwarmAverager", lambda *a, **k: FakeAverager(calls, *a, **k))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = config(*flags)
    with torch.device("meta"):
        shapes = [
            p.detach() for p in torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).parameters()
        ]
    outer = start_averagers(cfg, shapes, dht=None, keys=None, board=None, beat=lambda stage: None)
    assert outer.rounds is None and not outer.averager.serving  # nothing to serve yet
    build_outer(cfg, model, inner, outer)
    assert calls == ["averager", "theta", "serving"]
    sizes = [p.shape for p in model.parameters()]
    kept = bool(flags)
    assert (
        outer.averager.shapes == (sizes * 2 if kept else sizes) and outer.averager.masks == len(sizes) * kept
    )
    assert outer.averager.state_provider().outer_step == 0  # the state served is DiLoCo's


def test_streaming_starts_one_averager_per_fragment_and_serves_fragment_0s_state(monkeypatch):
    calls: list[str] = []
    groups: list[str] = []

    def averager(*args, group, serve_state, serving, **kwargs):
        groups.append((group, serve_state))
        return FakeAverager(calls, *args, **kwargs)

    monkeypatch.setattr("swarm.averaging.SwarmAverager", averager)
    cfg = config("--method", "streaming", "--fragments", "2")
    device, corpus, _ = load_data(cfg)
    model, inner = build_model_and_optimizer(cfg, device, corpus)
    outer = start_averagers(cfg, trained_shapes(cfg, corpus), dht=None, keys=None, board=None, beat=print)
    build_outer(cfg, model, inner, outer)
    assert groups == [("fragment0", True), ("fragment1", False)]
    numel = sum(sum(torch.Size(s).numel() for s in a.shapes) for a in outer.averagers)
    assert numel == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert all(a.serving for a in outer.averagers)  # start_serving serves only where serve_state
    assert outer.averager.state_provider().outer_step == 0


def test_a_presets_shapes_cost_no_import_of_torch_dynamo():
    """torch fills a meta tensor's normal_ through its Python reference, whose first call imports
    torch._dynamo: 1.6-2.2 s on every peer's start. The shapes skip the fills."""
    script = (
        "import sys\n"
        "from workbench.cli.command import build_config, build_parser\n"
        "from workbench.run.training import load_data, trained_shapes\n"
        "cfg = build_config(build_parser().parse_args(['start', '--model', 'small']))\n"
        "shapes = trained_shapes(cfg, load_data(cfg)[1])\n"
        "assert shapes and all(s.is_meta for s in shapes)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_data_parallel_peer_clips_its_gradient_and_its_state_keeper_clips_nothing(monkeypatch):
    """``--clip-norm`` on a dp peer: the gradient it sends is clipped (DataParallel); the
    DiLoCo(H=1) that keeps θ for joiners clips nothing (it clipped each step's parameter change)."""
    calls: list[str] = []
    monkeypatch.setattr("swarm.averaging.SwarmAverager", lambda *a, **k: FakeAverager(calls, *a, **k))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = config("--method", "dp", "--clip-norm", "0.5")
    outer = start_averagers(
        cfg, list(model.parameters()), dht=None, keys=None, board=None, beat=lambda stage: None
    )
    build_outer(cfg, model, inner, outer)
    assert outer.dp is not None and outer.dp.clip_norm == 0.5 and outer.dp.averager is outer.averager
    assert outer.rounds.config.clip_norm == 0.0 and cfg.diloco.clip_norm == 0.5
    assert outer.dp.outlier_ratio == 10.0  # DiLoCo's default check, on each step's gradients
    # ... which --outlier-ratio sets, 0 turning it off (dp refused the flag, and checked at 10
    # whatever the user wanted: a review, stop 72)
    for ratio in ("0", "4"):
        cfg = config("--method", "dp", "--outlier-ratio", ratio)
        outer = start_averagers(
            cfg, list(model.parameters()), dht=None, keys=None, board=None, beat=lambda stage: None
        )
        build_outer(cfg, model, inner, outer)
        assert outer.dp.outlier_ratio == float(ratio)


@pytest.mark.parametrize("joins", [False, True])
def test_a_joiner_serves_its_state_only_once_its_download_is_done(monkeypatch, tmp_path, joins):
    """Before its download a joiner holds the seed's init at outer step 0: served, a peer far
    into the run that had to download was offered it and took it (the churn soak). The run's
    first peer serves from the start."""
    import dataclasses

    calls: list[str] = []
    cfg = config("--rounds", "1", "--run-dir", str(tmp_path / "run"))
    if joins:
        seed = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
        cfg = dataclasses.replace(cfg, network=dataclasses.replace(cfg.network, initial_peers=[seed]))
    peer = peer_module.Peer(cfg)

    # setup(): the outer loop is built serving or not.
    session = types.SimpleNamespace(dht=None, board=None, store=None, peer_id="QmPeer")
    monkeypatch.setattr(peer_module, "connect", lambda network, keys: session)
    monkeypatch.setattr(peer_module.joining, "check_run_exists", lambda *args: None)
    monkeypatch.setattr(peer_module, "start_averagers", lambda *args, **kwargs: None)
    monkeypatch.setattr(peer, "_check_manifest", lambda: None)
    built: list[bool] = []

    def build_outer(cfg, model, inner, outer, *, serve=True):
        built.append(serve)
        raise Stop

    monkeypatch.setattr(peer_module, "build_outer", build_outer)
    with pytest.raises(Stop):
        peer.setup()
    assert built == [not joins]

    # run(): a joiner starts serving after its download, at the step it downloaded.
    def setup():
        averager = FakeAverager(calls, None, tensors_like=[], state_provider=None)
        rounds = types.SimpleNamespace(outer_step_count=0)
        peer.outer = peer_module.OuterLoop(rounds=rounds, averager=averager, averagers=[averager])
        peer.diloco, peer.board, peer.beat = peer.outer.rounds, None, lambda stage=None: None
        if not joins:
            peer.outer.start_serving()  # as build_outer(serve=True) does

    def download_state(reason, **kwargs):
        calls.append("download")
        peer.diloco.outer_step_count = 7
        return True

    monkeypatch.setattr(peer, "setup", setup)
    monkeypatch.setattr(peer, "download_state", download_state)
    monkeypatch.setattr(peer_module.joining, "peer_batches", lambda *args: None)
    monkeypatch.setattr(peer_module.joining, "wait_for_peers", lambda *a, **k: calls.append("wait"))
    monkeypatch.setattr(peer, "evaluate", lambda: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        peer.run()
    served = ["averager", "download", "serving", "wait"] if joins else ["averager", "serving", "wait"]
    assert calls == served
    assert peer.outer.averager.priority == (7 if joins else 0)  # at the step it downloaded
