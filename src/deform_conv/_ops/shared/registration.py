"""How an op's Python parts are registered with its schema once the library that defines it is loaded: the fake
kernels, the autograd formula (its backward an op of its own), the refusal of double backward, the autocast
kernel (register_op, for the ops of the DCNv3 family: each op's ``function.py`` says what to register), and the
refusal of sparse tensors (refuse_sparse, for every op)."""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

# Holds the autocast registrations for as long as the process runs (dropping a Library unregisters them).
_libraries: List[torch.library.Library] = []
_registered: Dict[str, bool] = {}


def _no_double_backward(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{name} does not support double backward: its gradient is not differentiable "
            "(do not pass create_graph=True through it, e.g. for gradient penalties)"
        )

    return backward


# The sparse layouts' dispatch keys: with no kernel there, the dispatcher would answer a sparse argument with a
# NotImplementedError naming the backend, not the argument.
_SPARSE_KEYS = ("SparseCPU", "SparseCUDA", "SparseMeta", "SparseCsrCPU", "SparseCsrCUDA", "SparseCsrMeta")


def _dense_only(qualified: str):
    """A kernel for the sparse keys: the error naming the first sparse argument, as the op's Python checks do."""
    namespace, name = qualified.split("::")
    arguments = [a.name for a in getattr(getattr(torch.ops, namespace), name).default._schema.arguments]

    def kernel(*args, **kwargs):
        for argument, value in list(zip(arguments, args)) + list(kwargs.items()):
            if isinstance(value, torch.Tensor) and value.layout != torch.strided:
                raise TypeError(f"{argument} must be a dense (strided) tensor, got layout {value.layout}")
        raise TypeError(f"{name} takes dense (strided) tensors only")

    return kernel


def refuse_sparse(name: str) -> None:
    """Op ``deform_conv::<name>`` and its backward refuse sparse tensors with a TypeError naming the argument."""
    library = torch.library.Library("deform_conv", "IMPL")
    for op in (name, f"{name}_backward"):
        for key in _SPARSE_KEYS:
            library.impl(op, _dense_only(f"deform_conv::{op}"), key)
    _libraries.append(library)


def register_op(name: str, forward_fake: Callable, backward_fake: Callable, backward: Callable,
                setup_context: Callable, autocast_kernel: Callable[[str], Callable]) -> None:
    """Registers op ``deform_conv::<name>`` and ``<name>_backward``'s Python parts, once. ``autocast_kernel(device
    type)`` returns the op's kernel under autocast on that device."""
    if _registered.get(name):
        return
    torch.library.register_fake(f"deform_conv::{name}", forward_fake)
    torch.library.register_fake(f"deform_conv::{name}_backward", backward_fake)
    torch.library.register_autograd(f"deform_conv::{name}", backward, setup_context=setup_context)
    torch.library.register_autograd(f"deform_conv::{name}_backward", _no_double_backward(name),
                                    setup_context=lambda ctx, inputs, output: None)
    library = torch.library.Library("deform_conv", "IMPL")
    for device_type, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        library.impl(name, autocast_kernel(device_type), key)
    _libraries.append(library)
    refuse_sparse(name)
    _registered[name] = True
