"""optim.eager: torch's AdamW and SGD, stepping without importing torch's compiler."""

from __future__ import annotations

import subprocess
import sys

import torch

from optim.eager import SGD, AdamW


def _train(adamw: type[torch.optim.Optimizer], sgd: type[torch.optim.Optimizer]):
    """Five inner AdamW steps and five outer Nesterov SGD steps, then a state dict round trip."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    inner = adamw(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    global_params = [p.detach().clone() for p in model.parameters()]
    outer = sgd(global_params, lr=0.7, momentum=0.9, nesterov=True)
    hooked = []
    inner.register_step_post_hook(lambda optimizer, args, kwargs: hooked.append(optimizer))
    for _ in range(5):
        inner.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        inner.step()
        for g, p in zip(global_params, model.parameters()):
            g.grad = g - p.detach()
        outer.step()
    inner.load_state_dict(inner.state_dict())
    outer.load_state_dict(outer.state_dict())
    assert len(hooked) == 5, "step hooks run"
    return [p.detach() for p in model.parameters()] + global_params, inner.state_dict(), outer.state_dict()


def _same_state(a: dict, b: dict) -> bool:
    """Two optimizer state dicts, equal bit for bit."""
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in ((a["state"][i], b["state"][i]) for i in a["state"])
    )


def test_the_same_steps_and_state_as_torchs_own():
    got, expected = _train(AdamW, SGD), _train(torch.optim.AdamW, torch.optim.SGD)
    assert all(torch.equal(a, b) for a, b in zip(got[0], expected[0]))
    assert _same_state(got[1], expected[1]) and _same_state(got[2], expected[2])
    assert got[1]["state"] and all(got[2]["state"][i]["momentum_buffer"] is not None for i in got[2]["state"])
    assert isinstance(AdamW([torch.zeros(1, requires_grad=True)]), torch.optim.AdamW)


def test_a_step_leaves_the_grad_mode_as_it_found_it():
    param = torch.zeros(2, requires_grad=True)
    optimizer = AdamW([param], lr=0.1)
    param.grad = torch.ones(2)
    with torch.no_grad():
        optimizer.step()
        assert not torch.is_grad_enabled()
    optimizer.step()  # in grad mode: the step turns it off inside (an in-place update of a leaf
    assert torch.is_grad_enabled()  # that requires grad would raise otherwise), then back on


def test_torchs_step_hooks_are_unwrapped_too():
    """torch wraps a class's step in its profiling hooks at the class's first instance: the
    plain step lies under both that and the grad-mode wrapper."""
    from optim.eager import _unwrapped

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert getattr(torch.optim.SGD.step, "hooked", False)
    plain = _unwrapped(torch.optim.SGD.step)
    assert plain.__code__.co_filename.endswith("sgd.py") and plain.__name__ == "step"
    assert AdamW.step.__qualname__ == "AdamW.step"


def test_a_process_that_trains_never_imports_the_compiler():
    """The point of the classes: a peer's inner and outer steps leave torch._dynamo unloaded
    (it costs about as much CPU as ``import torch``). Fails if a torch upgrade moves the import."""
    script = (
        "import sys, torch\n"
        "from optim.eager import AdamW, SGD\n"
        "from optim.inner import inner_step\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.lin = torch.nn.Linear(4, 3)\n"
        "    def forward(self, x, y):\n"
        "        logits = self.lin(x); return logits, torch.nn.functional.cross_entropy(logits, y)\n"
        "net = Net(); inner = AdamW(net.parameters(), lr=1e-3)\n"
        "outer = SGD([p.detach().clone() for p in net.parameters()], lr=0.7, momentum=0.9, nesterov=True)\n"
        "for _ in range(2):\n"
        "    inner_step(net, inner, torch.randn(2, 4), torch.tensor([0, 2]), grad_clip=1.0)\n"
        "    for g in outer.param_groups[0]['params']: g.grad = torch.ones_like(g)\n"
        "    outer.step()\n"
        "inner.load_state_dict(inner.state_dict()); outer.load_state_dict(outer.state_dict())\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
