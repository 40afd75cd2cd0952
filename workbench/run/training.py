"""What one process trains with: data, model and inner optimizer built the same way on every
peer and every rank of a node, and the inner step they all take."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from optim.eager import AdamW
from optim.inner import inner_step
from workbench.config import RunConfig
from workbench.run.data import EVAL_BATCH_SIZE, ByteCorpus
from workbench.run.model import ModelConfig, autocast_context, build_model, pick_device


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    grad_clip: float,
    before_step: Callable[[], None],
) -> torch.Tensor:
    """:func:`optim.inner.inner_step` on ``device``, in bf16 autocast on CUDA: the one inner
    step of a peer and of a node's other ranks."""
    return inner_step(
        model,
        optimizer,
        x,
        y,
        device=device,
        grad_clip=grad_clip,
        before_step=before_step,
        autocast=lambda: autocast_context(device),
    )


@dataclasses.dataclass
class Training:
    """What one process needs to train: the same on every peer and every rank of a node."""

    device: torch.device
    corpus: ByteCorpus
    eval_set: list
    model: torch.nn.Module
    inner_optimizer: torch.optim.Optimizer


def build_training(cfg: RunConfig) -> Training:
    """Data, model (seeded: identical θ on every peer before any download) and inner AdamW."""
    device, corpus, eval_set = load_data(cfg)
    return Training(device, corpus, eval_set, *build_model_and_optimizer(cfg, device, corpus))


def load_data(cfg: RunConfig) -> tuple[torch.device, ByteCorpus, list]:
    """The device, the corpus (checked against the context length) and the held-out batches: what
    a bad ``--dataset`` fails on, before anything else is started."""
    device = pick_device(cfg.peer.device)
    corpus = ByteCorpus.load(cfg.data, shard=cfg.peer.shard, num_shards=cfg.peer.num_shards)
    corpus.check_fits(cfg.model.block_size)
    eval_set = corpus.eval_batches(
        block_size=cfg.model.block_size, batch_size=EVAL_BATCH_SIZE, num_batches=cfg.peer.eval_batches
    )
    return device, corpus, eval_set


def trained_shapes(cfg: RunConfig, corpus: ByteCorpus) -> list[torch.Tensor]:
    """The model's trained parameters as ``meta`` tensors: their shapes, in order, with no memory
    behind them. The averagers are made like these before the model exists (see
    :func:`workbench.run.outer.start_averagers`)."""
    with torch.device("meta"), _NoInitialisation():
        model = _model(cfg, corpus, shapes_only=True)
    return [p.detach() for p in model.parameters() if p.requires_grad]


class _NoInitialisation(TorchFunctionMode):
    """Skips filling ``meta`` tensors (there are no values to fill). torch runs ``normal_`` on
    the meta device through its Python reference, whose first call imports ``torch._dynamo``:
    1.6-2.2 s added to every peer's start, once per process."""

    FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "fill_", "zero_", "copy_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.FILLS:
            tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
            if getattr(tensor, "is_meta", False):
                return tensor
        return func(*args, **kwargs)


def build_model_and_optimizer(
    cfg: RunConfig, device: torch.device, corpus: ByteCorpus
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model on ``device`` (seeded, or a Hugging Face folder's) and its inner AdamW."""
    model = _model(cfg, corpus).to(device)
    inner_optimizer = AdamW(
        model.parameters(),
        lr=cfg.train.inner_lr,
        weight_decay=cfg.train.weight_decay,
        betas=(cfg.train.beta1, cfg.train.beta2),
    )
    return model, inner_optimizer


def _model(cfg: RunConfig, corpus: ByteCorpus, *, shapes_only: bool = False) -> torch.nn.Module:
    return network(cfg.model, cfg.hf_model, corpus, seed=cfg.peer.seed, shapes_only=shapes_only)


def network(
    shape: ModelConfig, hf_model: str | None, corpus: ByteCorpus, *, seed: int, shapes_only: bool = False
) -> torch.nn.Module:
    """The model a peer trains: a Hugging Face folder's (``hf_model``; of the preset ``shape``
    only its context length applies), else the preset, sized to the corpus' vocabulary (bytes,
    or a tokenizer's ids when --tokenizer is given). The simulator builds its peers' with it too."""
    if hf_model:
        import workbench.run.hf as hf

        return hf.load_model(
            hf_model,
            seed=seed,
            block_size=shape.block_size,
            vocab_size=corpus.vocab_size,
            shapes_only=shapes_only,
        )
    return build_model(dataclasses.replace(shape, vocab_size=corpus.vocab_size), seed=seed)
