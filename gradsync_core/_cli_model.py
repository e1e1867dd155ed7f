"""``gradsync plan --model MODULE:FUNCTION``: the parameters of a live model.

The function is found as ``gradsync checkpoint export --model`` finds its own
(``_cli_interchange``: a module on the Python path or in the current directory, or a ``.py``
file) and takes no arguments; it returns the model: a torch ``nn.Module``, a Flax NNX module,
or a JAX parameter tree (linen's ``variables`` or ``params``, arrays or
``jax.ShapeDtypeStruct``). Its specs come from the executor of the framework the model
belongs to, imported now by name, so ``gradsync_core`` stays standard library only and the
plan is the executor's: ``gradsync_torch.param_specs`` (registration order, a tied weight
once, frozen ones marked) or ``gradsync_jax.torch_specs`` (torch's names and layouts, the
names ``--units`` takes).

A torch module shows its tied weights (one parameter under two names) by identity: they are
the default ``--tied``. A Flax tree holds a tied weight once and cannot show where else it is
used: name it with ``--tied``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

from gradsync_core._cli_interchange import _factory
from gradsync_core._specs import ParamSpec

_RETURN = "return the model: a torch nn.Module, a Flax NNX module or a JAX parameter tree"


def is_live_model(model: str) -> bool:
    """Whether ``--model`` names a function (``MODULE:FUNCTION``) rather than a built-in."""
    return ":" in model


def live_model(spec: str) -> tuple[list[ParamSpec], tuple[str, ...]]:
    """The specs of the model ``spec``'s function returns and its tied weights' names.

    Args:
        spec: ``MODULE:FUNCTION``.

    Returns:
        The specs in registration order, and the names (as listed) of the parameters used
        under more than one name (a torch module's tied weights; none for a Flax tree).

    Raises:
        ValueError: a ``spec`` that names no function, a framework that does not import, or
            a return value that is not a model.
    """
    try:
        function = _factory(spec)
    except ImportError as err:  # the module itself, or one it imports, is not there
        raise ValueError(f"--model {spec!r}: cannot import its module ({err})") from None
    built = function()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(built, torch.nn.Module):
        specs, tied = _torch_specs(spec, built)
    elif isinstance(built, Mapping) or _is_nnx_module(built):
        specs, tied = _jax_specs(spec, built), ()
    else:
        raise ValueError(f"--model {spec!r} returned {type(built).__name__}; {_RETURN}")
    if not specs:
        raise ValueError(f"--model {spec!r} returned a model with no parameters; {_RETURN}")
    return specs, tied


def _executor(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(
            f"--model {spec!r} needs {name} to read the model, and importing it failed ({err})"
        ) from None


def _torch_specs(spec: str, model: Any) -> tuple[list[ParamSpec], tuple[str, ...]]:
    specs = _executor("gradsync_torch", spec).param_specs(model)
    first: dict[int, str] = {}
    tied: dict[str, None] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[first[id(param)]] = None  # listed under its first name, as param_specs does
        first.setdefault(id(param), name)
    return specs, tuple(tied)


def _is_nnx_module(model: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def _jax_specs(spec: str, tree: Any) -> list[ParamSpec]:
    """Torch-named specs of a Flax tree: an NNX module's ``Param`` state, linen's ``params``
    collection (not ``batch_stats`` and the like), or the tree as given."""
    if _is_nnx_module(tree):
        nnx = sys.modules["flax.nnx"]
        tree = nnx.state(tree, nnx.Param)
    elif isinstance(tree, Mapping) and "params" in tree:
        tree = {"params": tree["params"]}
    try:
        return _executor("gradsync_jax", spec).torch_specs(tree)
    except (AttributeError, TypeError) as err:  # a leaf without a shape or dtype
        raise ValueError(
            f"--model {spec!r} returned a tree with a leaf that is not an array ({err}); " + _RETURN
        ) from None
