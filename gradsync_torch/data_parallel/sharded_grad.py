"""What ``param.grad`` holds after a ZeRO-2 sync: a placeholder that refuses to be read.

Under ``DataParallel(shard_gradients=True)`` each rank keeps only its shard of every reduced
bucket (arXiv:1910.02054 §5.2), so no rank has a parameter's whole gradient. Left as ``None``,
``param.grad`` reads as "no gradient": ``torch.nn.utils.clip_grad_norm_(model.parameters(),
c)`` then returns 0.0 and clips nothing, and a logger of gradient norms prints nothing, without
a word. ``ShardedGradient`` says where the gradient is instead: it has the parameter's shape,
dtype and device (so torch's ``.grad`` setter takes it) but no storage, and any operation that
would read or write its values raises one sentence naming what to call instead. Its metadata
(``shape``, ``dtype``, ``device``, ``numel()``) stays readable.

A tensor subclass is the one way to refuse there without patching torch: torch's clip reads
``p.grad`` and calls ``torch.linalg.vector_norm`` / ``torch._foreach_norm`` on it, which
reach ``__torch_function__``; autograd accumulating onto it (a second synced backward without
``zero_grad()``) reaches ``__torch_dispatch__``. ``zero_grad()`` (``set_to_none=True``, the
default) removes it like any gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

# Metadata that reads no values: allowed, so code that only looks at shapes keeps working
# (and a placeholder can be a dict key or printed).
_METADATA = frozenset(
    {
        torch.Tensor.__hash__,
        torch.Tensor.__len__,
        torch.Tensor.__format__,
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.stride,
        torch.Tensor.is_contiguous,
    }
)


def refusal(name: str, op: str) -> RuntimeError:
    """The sentence for ``op`` reaching the placeholder gradient of parameter ``name``."""
    return RuntimeError(
        f"the gradient of {name!r} is sharded over the data-parallel ranks "
        "(DataParallel(shard_gradients=True), ZeRO-2): each rank holds only its piece, inside "
        f"the ZeroRedundancyOptimizer, so param.grad is a placeholder that {op} cannot use; "
        "clip with opt.clip_grad_norm_(max_norm) (it returns the global norm), clear "
        "gradients with opt.zero_grad() before the next synced backward, and accumulate "
        "micro-batches under model.no_sync()"
    )


def _op_name(func: Callable[..., Any]) -> str:
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or func)
    for inner, public in (("_VariableFunctionsClass.", "torch."), ("TensorBase.", "Tensor.")):
        if name.startswith(inner):
            return public + name[len(inner) :]
    return name


class ShardedGradient(torch.Tensor):
    """A storage-less stand-in for ``param.grad`` whose gradient lives in ZeRO-2 shards.

    Args:
        param: the parameter (its shape, dtype and device are copied).
        name: the parameter's name, for the error message.
    """

    param_name: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str) -> ShardedGradient:
        out = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device
        )
        out.param_name = name
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ShardedGradient({self.param_name!r}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}: held in shards by the ZeroRedundancyOptimizer)"
        )

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise refusal(_name_in(args, kwargs), _op_name(func))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's documented classmethod form
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        op = f"{func} (a backward accumulating onto it, or torch internals)"
        raise refusal(_name_in(args, kwargs or {}), op)


def _name_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, ShardedGradient):
            return leaf.param_name
    return "a parameter"
