"""The spec tree: a layer is described by which classes build it, not by model code.

`ModuleSpec(module, params, submodules)` names a class (or an import path `("pkg.mod", "Name")`),
the keyword arguments to build it with, and a dataclass of the specs of its own children.
Swapping attention or MLP for another implementation is a change of spec (Megatron's idiom).
"""

import importlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Tuple, Union


@dataclass
class ModuleSpec:
    """module: class, function, or ("import.path", "Name"); params: extra constructor kwargs;
    submodules: the dataclass of child specs passed to the constructor as `submodules=`."""

    module: Union[Tuple[str, str], type, Callable]
    params: dict = field(default_factory=dict)
    submodules: Any = None


def import_module(module_path: Tuple[str, str]):
    """The object named by ("package.module", "Name")."""
    base_path, name = module_path
    try:
        return getattr(importlib.import_module(base_path), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"ModuleSpec module {module_path!r} cannot be imported: {e}") from e


def get_module(spec_or_module):
    """The class or function a spec (or a bare class/function) stands for, without building it."""
    if isinstance(spec_or_module, ModuleSpec):
        spec_or_module = spec_or_module.module
    if isinstance(spec_or_module, tuple):
        return import_module(spec_or_module)
    return spec_or_module


def build_module(spec_or_module, *args, **kwargs):
    """Instantiate a spec: `module(*args, **spec.params, **kwargs, submodules=spec.submodules)`.

    A plain function (or a spec of one) is returned as is, so specs can name factories such as
    `get_bias_dropout_add`.
    """
    module = get_module(spec_or_module)
    if isinstance(module, (types.FunctionType, types.BuiltinFunctionType)):
        return module
    if not isinstance(spec_or_module, ModuleSpec):
        return module(*args, **kwargs)
    params = {**spec_or_module.params, **kwargs}
    if spec_or_module.submodules is not None:
        params["submodules"] = spec_or_module.submodules
    try:
        return module(*args, **params)
    except TypeError as e:
        raise TypeError(f"building {getattr(module, '__name__', module)} from its ModuleSpec: {e}") from e
