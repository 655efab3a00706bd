"""A fake accelerator for CPU tests: tensors on device ``"fakegpu"`` that refuse to mix
with CPU tensors the way CUDA tensors do.

The first contact with a GPU found code that built an index or a metric on the CPU
and combined it with rows on the GPU (``index_select`` with a CPU index, a CUDA
log-prob minus a CPU one). CPU tests cannot see that: every tensor is on the CPU.
Here, ``torch.device("fakegpu")`` is a second device whose tensors live in host
memory but behave, for device checks, like CUDA's:

- an op that mixes a ``fakegpu`` tensor with a CPU tensor of one or more dimensions
  raises ``RuntimeError: Expected all tensors to be on the same device`` (CUDA lets a
  0-dim CPU tensor take part, and accepts CPU index tensors in advanced indexing:
  so does this device);
- ``.to("fakegpu")``, ``.cpu()``, ``copy_`` between the devices, factories with
  ``device="fakegpu"``, ``.item()`` and ``.tolist()`` work as on CUDA;
- a random op on a ``fakegpu`` tensor refuses a CPU ``torch.Generator`` (CUDA does);
- ``torch.autocast("fakegpu")`` is accepted and casts nothing.

It is torch's PrivateUse1 dispatch key renamed to ``fakegpu`` with a Python backend
(:func:`torch.utils.backend_registration._setup_privateuseone_for_python_backend`):
factories return a wrapper tensor subclass around a CPU tensor, whose
``__torch_dispatch__`` checks the devices and runs the op on the CPU tensors. Call
:func:`install` once per process (the rename cannot be undone); import it only in
tests that use it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

NAME = "fakegpu"
"""The device type."""

_LOCK = threading.Lock()
_INSTALLED = False
UNAVAILABLE: str | None = None
"""Why this process has no fake device (set by the test session), or None."""

_ACCEPTS_CPU_INDICES = frozenset({
    "aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_",
})
"""Ops to which CUDA passes CPU index tensors (``x[idx]``, ``x[idx] = v``)."""

_MOVES = frozenset({"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"})
"""Ops whose purpose is to move data between devices."""


def device(index: int = 0) -> torch.device:
    """The fake device (installs it on first use)."""
    install()
    return torch.device(NAME, index)


def require() -> None:
    """Skip the calling test when this process has no fake device."""
    import pytest

    if UNAVAILABLE is not None:
        pytest.skip(UNAVAILABLE)


class FakeGpuTensor(torch.Tensor):
    """A tensor on the fake device: a CPU tensor (``inner``) behind a device check."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> FakeGpuTensor:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, layout=inner.layout, device=torch.device(NAME, 0),
            requires_grad=inner.requires_grad)
        out.inner = inner
        return out  # type: ignore[no-any-return]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{self.inner!r} (on {NAME})"

    def tolist(self) -> Any:  # torch refuses it for subclasses; CUDA tensors have it
        return self.inner.tolist()

    def numpy(self, *, force: bool = False) -> Any:  # as CUDA: copy to the CPU first
        raise TypeError(f"can't convert {NAME}:0 device type tensor to numpy. Use Tensor.cpu() to copy "
                        "the tensor to host memory first.")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        _check_devices(func, name, args, kwargs)
        if name == "aten::_to_copy":
            target = kwargs.get("device")
            moved = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
            on_fake = isinstance(args[0], FakeGpuTensor) if target is None else torch.device(target).type == NAME
            return FakeGpuTensor(moved) if on_fake else moved
        if name in ("aten::copy_", "aten::_copy_from"):
            dst = args[0] if name == "aten::copy_" else args[1]
            src = args[1] if name == "aten::copy_" else args[0]
            _unwrap(dst).copy_(_unwrap(src), non_blocking=False)
            return dst
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return tree_map(_wrap, out)


def _unwrap(x: Any) -> Any:
    if isinstance(x, FakeGpuTensor):
        return x.inner
    if isinstance(x, torch.device) and x.type == NAME:
        return torch.device("cpu")
    return x


def _wrap(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, FakeGpuTensor) and x.device.type == "cpu":
        return FakeGpuTensor(x)
    return x


def _check_devices(func: Any, name: str, args: Any, kwargs: Any) -> None:
    if name in _MOVES:
        return
    flat, _ = tree_flatten((args, kwargs))
    for value in flat:
        if isinstance(value, torch.Generator) and value.device.type != NAME:
            raise RuntimeError(f"Expected a '{NAME}' device type for generator but found "
                               f"'{value.device.type}' (in {func})")
        if (isinstance(value, torch.Tensor) and not isinstance(value, FakeGpuTensor)
                and value.device.type == "cpu" and value.dim() > 0 and name not in _ACCEPTS_CPU_INDICES):
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                               f"devices, {NAME}:0 and cpu! (in {func})")


def _empty(size: Any, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
           memory_format: Any = None) -> FakeGpuTensor:
    return FakeGpuTensor(torch.empty(size, dtype=dtype, memory_format=memory_format))


def _empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> FakeGpuTensor:
    return FakeGpuTensor(torch.empty_strided(size, stride, dtype=dtype))


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    _unwrap(dst).copy_(_unwrap(src))
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    inner = _unwrap(dst)
    inner.resize_(src.shape)
    inner.copy_(_unwrap(src))
    return dst


def _local_scalar_dense(x: torch.Tensor) -> Any:
    return _unwrap(x).item()


class _Module:
    """``torch.fakegpu``: what torch asks of a device module (autocast's dtypes included)."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    def current_stream(self, device: Any = None) -> _Stream:
        return _STREAM

    def stream(self, stream: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def synchronize(self, device: Any = None) -> None:
        pass


class _Stream:
    """The device's one stream: work is done when it returns (DCP asks for streams)."""

    device_type = NAME

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


_STREAM = _Stream()


_LIBRARIES: list[torch.library.Library] = []


def install() -> None:
    """Register the ``fakegpu`` device in this process (idempotent)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME, backend_module=_Module())
        lib = torch.library.Library("aten", "IMPL")  # the backend's kernels (kept alive below)
        lib.impl("empty.memory_format", _empty, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        lib.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
        lib.impl("_local_scalar_dense", _local_scalar_dense, "PrivateUse1")
        # Autocast passes through (no op is cast on this device): precision is not
        # what it tests, and torch registers no autocast kernels for PrivateUse1.
        autocast = torch.library.Library("_", "IMPL")
        autocast.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
        _LIBRARIES.extend((lib, autocast))
        _INSTALLED = True
