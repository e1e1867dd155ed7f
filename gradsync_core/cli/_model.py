"""``gradsync plan --model MODULE:FUNCTION``: the parameters of a live model.

The function is found as ``gradsync checkpoint export --model`` finds its own
(``_interchange``: a module on the Python path or in the current directory, or a ``.py``
file) and takes no arguments; it returns the model: a torch ``nn.Module``, a Flax NNX module,
or a JAX parameter tree (linen's ``variables`` or ``params``, arrays or
``jax.ShapeDtypeStruct``). Its specs come from the executor of the framework the model
belongs to, through its ``gradsync.model_readers`` entry point (``_plugins``), so
``gradsync_core`` stays standard library only and the plan is the executor's: torch's
``param_specs`` (registration order, a tied weight once, frozen ones marked) or JAX's
``torch_specs`` (torch's names and layouts, the names ``--units`` takes).

A torch module shows its tied weights (one parameter under two names) by identity: they are
the default ``--tied``. A Flax tree holds a tied weight once and cannot show where else it is
used: name it with ``--tied``.
"""

from __future__ import annotations

from gradsync_core.cli._interchange import _factory
from gradsync_core.cli._plugins import model_readers
from gradsync_core.plan._specs import ParamSpec

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
        ValueError: a ``spec`` that names no function, or a return value that is not a
            model of a framework gradsync has an executor for.
    """
    try:
        function = _factory(spec)
    except ImportError as err:  # the module itself, or one it imports, is not there
        raise ValueError(f"--model {spec!r}: cannot import its module ({err})") from None
    built = function()
    for _, read in model_readers():
        try:
            found = read(built)
        except ValueError as err:
            raise ValueError(f"--model {spec!r} returned {err}; {_RETURN}") from None
        if found is not None:
            specs, tied = found
            break
    else:
        raise ValueError(f"--model {spec!r} returned {type(built).__name__}; {_RETURN}")
    if not specs:
        raise ValueError(f"--model {spec!r} returned a model with no parameters; {_RETURN}")
    return specs, tied
