"""The heads of a mace model: a multihead model (mace-mh-1, or the result of multihead
fine-tuning) predicts through one of several readout heads; ``pt_head`` is the replayed
pre-training head mace adds. :func:`select_head` reduces a model to the head a command asks for
(mace's ``remove_pt_head``), the way ``workbench eval --head``, ``md --head`` and
``TrainConfig.foundation_head`` choose one.
"""

from __future__ import annotations

import os

import torch

from workbench.train.replay_options import PT_HEAD  # one owner, importable without torch

__all__ = ["PT_HEAD", "HeadError", "heads_of", "select_head"]


class HeadError(ValueError):
    """A head that the model does not have, or a choice left open; the message lists the heads."""


def heads_of(model: torch.nn.Module) -> tuple[str, ...]:
    """The model's head names, in order (``("Default",)`` for a model saved without any)."""
    return tuple(str(h) for h in getattr(model, "heads", None) or ["Default"])


def select_head(
    model: torch.nn.Module, head: str | None, path: str | os.PathLike, option: str = "--head"
) -> tuple[str, torch.nn.Module]:
    """``(name, model)`` with ``model`` reduced to head ``head``. ``head=None`` takes the only
    head, or the only one that is not ``pt_head``; any other open choice is an error naming
    ``option`` and listing the heads. A one-head model comes back as it is."""
    heads = heads_of(model)
    if head is not None and head not in heads:
        raise HeadError(f"{option}: {head!r} is not a head of {path}; its heads: {', '.join(heads)}")
    if len(heads) == 1:
        return heads[0], model
    if head is None:
        candidates = [h for h in heads if h != PT_HEAD]
        if len(candidates) != 1:
            raise HeadError(f"{option}: {path} has heads {', '.join(heads)}; name the one to use")
        head = candidates[0]
    from mace.tools.scripts_utils import remove_pt_head

    from workbench.dtypes import default_dtype

    with default_dtype(next(model.parameters()).dtype):  # mace rebuilds the model in the default dtype
        return head, remove_pt_head(model, head)
