"""swap_modules / restore_modules: put fastattn's modules into an existing model in place.

Each torch.nn.MultiheadAttention, nn.LSTM, nn.LSTMCell, nn.GRU, nn.GRUCell, nn.RNN and
nn.RNNCell (exact classes) becomes the fastattn
module of the same family by changing the object's class: the module object, its Parameter
objects and buffers stay the same, so optimisers, state_dict keys and references held
elsewhere keep working. restore_modules changes the classes back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

logger = logging.getLogger("fastattn")

_ORIGINAL = "_fastattn_original_class"
_NESTED = "_fastattn_original_use_nested_tensor"


def _targets() -> list[tuple[type, Callable[[], type | None], str]]:
    """(torch class, fastattn class getter, family) for every swappable module."""
    from . import nn as fnn

    return [
        (nn.MultiheadAttention, lambda: fnn.MultiheadAttention, "attention"),
        (nn.LSTM, lambda: getattr(fnn, "LSTM", None), "lstm"),
        (nn.LSTMCell, lambda: getattr(fnn, "LSTMCell", None), "lstm"),
        (nn.GRU, lambda: fnn.GRU, "gru"),
        (nn.GRUCell, lambda: fnn.GRUCell, "gru"),
        (nn.RNN, lambda: fnn.RNN, "rnn"),
        (nn.RNNCell, lambda: fnn.RNNCell, "rnn"),
    ]


def swap_modules(
    model: nn.Module,
    *,
    attention: bool = True,
    lstm: bool = True,
    gru: bool = True,
    rnn: bool = True,
    backend: str | None = None,
) -> nn.Module:
    """Swap torch's attention and recurrent modules of a model for fastattn's, in place.

    Changes the class of every `torch.nn.MultiheadAttention` (attention=True), `nn.LSTM` and
    `nn.LSTMCell` (lstm=True), `nn.GRU` and `nn.GRUCell` (gru=True), `nn.RNN` and `nn.RNNCell`
    (rnn=True) of the model, the model itself included (exact classes only), to fastattn's. The
    module objects, their Parameters and buffers stay the same, so outputs, gradients,
    optimisers built earlier and state_dict keys keep working. Swapping twice is harmless; the
    swapped modules are logged at INFO on the "fastattn" logger.

    Args:
        model: The model, changed in place.
        attention: Swap `nn.MultiheadAttention`.
        lstm: Swap `nn.LSTM` and `nn.LSTMCell`.
        gru: Swap `nn.GRU` and `nn.GRUCell`.
        rnn: Swap `nn.RNN` and `nn.RNNCell`.
        backend: The fastattn backend the swapped modules use; None: the automatic choice.

    Returns:
        The model. `swap_summary(model)` lists what was swapped.
    """
    families = {"attention": attention, "lstm": lstm, "gru": gru, "rnn": rnn}
    plan: list[tuple[str, Any, type, type]] = []
    for name, module in model.named_modules():
        for torch_cls, fast_cls_getter, family in _targets():
            if type(module) is not torch_cls or not families[family]:
                continue
            fast_cls = fast_cls_getter()
            if fast_cls is None:  # checked for every module before anything is swapped
                raise RuntimeError(
                    f"swap_modules: fastattn has no replacement for "
                    f"{torch_cls.__name__} ({name or '<model>'}) in this version"
                )
            plan.append((name, module, torch_cls, fast_cls))
    swapped = []
    for name, module, torch_cls, fast_cls in plan:
        setattr(module, _ORIGINAL, torch_cls)
        if hasattr(fast_cls, "from_torch"):
            fast_cls.from_torch(module, backend=backend)
        else:
            module.__class__ = fast_cls
            module.fastattn_backend = backend
        swapped.append((name or "<model>", torch_cls.__name__, fast_cls.__name__))
    if attention:
        _disable_nested_tensor_encoders(model)
    for name, before, after in swapped:
        logger.info("fastattn.swap_modules: %s: %s -> fastattn.nn.%s", name, before, after)
    return model


def _disable_nested_tensor_encoders(model: nn.Module) -> None:
    """torch's TransformerEncoder may turn padded batches into NestedTensors in eval mode, which
    only its own fused layers understand: encoders holding swapped attention keep dense
    tensors (restore_modules puts the setting back)."""
    from .nn import MultiheadAttention

    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and getattr(
            module, "use_nested_tensor", False
        ):
            if any(isinstance(m, MultiheadAttention) for m in module.modules()):
                setattr(module, _NESTED, module.use_nested_tensor)
                module.use_nested_tensor = False


def restore_modules(model: nn.Module) -> nn.Module:
    """Undo `swap_modules`: every swapped module becomes its torch class again, in place.

    Args:
        model: A model `swap_modules` changed.

    Returns:
        The model.
    """
    for module in model.modules():
        original = getattr(module, _ORIGINAL, None)
        if original is not None:
            hooks = module._forward_pre_hooks
            for key in [
                k
                for k, hook in hooks.items()
                if getattr(hook, "__module__", "").startswith("fastattn.")
            ]:
                del hooks[key]
            module.__class__ = original
            delattr(module, _ORIGINAL)
            if hasattr(module, "fastattn_backend"):
                delattr(module, "fastattn_backend")
        if hasattr(module, _NESTED):
            module.use_nested_tensor = getattr(module, _NESTED)
            delattr(module, _NESTED)
    return model


def swap_summary(model: nn.Module) -> list[tuple[str, str, str]]:
    """The modules of a model that are currently swapped.

    Args:
        model: A model.

    Returns:
        A list of (qualified name, torch class name, fastattn class name), one per swapped module
        ("<model>" names the model itself).
    """
    out = []
    for name, module in model.named_modules():
        original = getattr(module, _ORIGINAL, None)
        if original is not None:
            out.append((name or "<model>", original.__name__, type(module).__name__))
    return out


__all__ = ["swap_modules", "restore_modules", "swap_summary"]
