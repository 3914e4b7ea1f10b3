"""Load model files and checkpoints without running code from them.

``torch.save`` of a module is a pickle, and a pickle can name any function to call while it
loads. Here every file goes through torch's ``weights_only`` unpickler, which calls only what
an allowlist names: the ``torch.nn.Module`` classes of mace-torch (``mace.modules``), e3nn,
``torch.nn`` and the workbench kernels, e3nn's irreps and instruction records, the activation
functions mace uses, and numpy's array rebuild (checkpoints hold numpy RNG states). The file is
scanned first; a name outside the allowlist refuses the file, naming it and ``--trust-model``.

Two pieces of a mace model carry code. e3nn's compiled parts are TorchScript archives, which run
torch operators only, never Python. mace's symmetric contraction holds ``torch.fx`` graph
modules, which torch pickles as Python source to ``exec``; :func:`_graph_module_from_code`
rebuilds them instead from that source's syntax tree, accepting only assignments of tensordot,
einsum and arithmetic, so nothing in the file is executed.

``trust=True`` is the escape hatch for other models: a full pickle, with a one-line warning.
"""

from __future__ import annotations

import ast
import importlib
import operator
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelFileError", "check_device", "load_model", "load_torch_file", "nonfinite_parameters"]

#: modules whose ``torch.nn.Module`` classes a model may be built from
MODULE_PACKAGES = ("mace.modules.", "e3nn.", "torch.nn.modules.", "workbench.kernels.", "cuequivariance_torch.")
#: other classes a mace model holds as values (irreps, instruction records, the fx tracer class)
VALUE_CLASSES = (
    "e3nn.o3._irreps.Irrep",
    "e3nn.o3._irreps.Irreps",
    "e3nn.o3._irreps._MulIr",
    "e3nn.o3._linear.Instruction",
    "e3nn.o3._tensor_product._instruction.Instruction",
    "torch.fx._symbolic_trace.Tracer",
    # a model saved with cuEquivariance layers (mace's --enable_cueq): their descriptors, plain data
    "mace.modules.wrapper_ops.CuEquivarianceConfig",
    "mace.tools.cg.O3_e3nn",
    "cuequivariance.group_theory.equivariant_polynomial.EquivariantPolynomial",
    "cuequivariance.group_theory.irreps_array.irreps.Irreps",
    "cuequivariance.group_theory.irreps_array.irreps.MulIrrep",
    "cuequivariance.group_theory.irreps_array.irreps_and_layout.IrrepsAndLayout",
    "cuequivariance.group_theory.irreps_array.irreps_layout.IrrepsLayout",
    "cuequivariance.segmented_polynomials.operation.Operation",
    "cuequivariance.segmented_polynomials.path.Path",
    "cuequivariance.segmented_polynomials.segmented_operand.SegmentedOperand",
    "cuequivariance.segmented_polynomials.segmented_polynomial.SegmentedPolynomial",
    "cuequivariance.segmented_polynomials.segmented_tensor_product.SegmentedTensorProduct",
    "cuequivariance.segmented_polynomials.subscripts.Subscripts",
)
#: activation functions a model may keep as attributes (mace's gates)
ACTIVATIONS = tuple(
    f"torch.nn.functional.{n}" for n in ("silu", "relu", "tanh", "sigmoid", "softplus", "gelu")
) + tuple(f"torch.{n}" for n in ("tanh", "sigmoid", "abs", "relu"))
TRUST_WARNING = (
    "workbench: warning: {path}: loading a full pickle (--trust-model); it can run any code it contains, "
    "so use this only for files from a source you trust"
)


class ModelFileError(ValueError):
    """A model or checkpoint file that is refused or unreadable; the message names the file."""


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; a ``ValueError`` naming it when it is not one or not here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {device}: not a torch device (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA GPU is available on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"--device {device}: only cpu and cuda devices are supported")
    return dev


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``model`` holding NaN or inf."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [n for n, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _resolve(name: str) -> Any | None:
    """The object an allowlisted global ``name`` refers to, or None when it is not allowed."""
    special = _special_globals()
    if name in special:
        return special[name]
    module_name, _, attr = name.rpartition(".")
    allowed_class = name in VALUE_CLASSES or name in ACTIVATIONS
    if not allowed_class and not any(name.startswith(p) for p in MODULE_PACKAGES):
        return None  # nothing outside the allowlist is even imported
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    if allowed_class or (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
        return obj
    return None


def _special_globals() -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {
        "torch.fx.graph_module.reduce_graph_module": _graph_module_from_body,
        "numpy.ndarray": np.ndarray,
        "numpy.dtype": np.dtype,
    }
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy's own array rebuild function
    for mod in ("numpy.core", "numpy._core"):
        out[f"{mod}.multiarray._reconstruct"] = reconstruct
    for name in dir(np.dtypes):
        if name.endswith("DType"):
            out[f"numpy.dtypes.{name}"] = getattr(np.dtypes, name)
    return out


def _not_readable(path: Path, why: str, what: str = "model file") -> ModelFileError:
    adjective = "readable" if what == "checkpoint" else "loadable"  # the wording the commands always used
    return ModelFileError(f"{path}: not a {adjective} {what} ({why})")


def _globals_in(path: Path, what: str) -> list[str]:
    """The names the pickle in ``path`` would look up, read without loading it."""
    if not zipfile.is_zipfile(path):
        raise _not_readable(path, "not the zip archive torch.save writes: truncated, or another kind of file", what)
    try:
        return sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path))))
    except Exception as exc:  # a damaged archive: any of zip, pickle or torch errors
        raise _not_readable(path, f"{type(exc).__name__}: {str(exc)[:120]}", what) from None


def refused_globals(path: str | os.PathLike) -> list[str]:
    """The names in the pickle at ``path`` that :func:`load_torch_file` would refuse (the file
    is scanned, not loaded): empty for a file that loads without ``trust``."""
    return [n for n in _globals_in(Path(path), "model file") if _resolve(n) is None]


def load_torch_file(
    path: str | os.PathLike,
    *,
    trust: bool = False,
    map_location: Any = "cpu",
    what: str = "model file",
    trust_hint: str = "pass --trust-model",
) -> Any:
    """The object ``torch.save`` wrote to ``path``, loaded without running code from it (see the
    module docstring); ``trust=True`` loads a full pickle after a warning on stderr. Raises
    :class:`ModelFileError` naming the file when it is missing, unreadable or refused (the
    refusal ends with ``trust_hint``, the way to load it anyway)."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such {what}")
    if trust:
        print(TRUST_WARNING.format(path=path), file=sys.stderr)
        try:
            return torch.load(path, map_location=map_location, weights_only=False)
        except Exception as exc:
            raise _not_readable(path, f"{type(exc).__name__}: {str(exc)[:120]}", what) from None
    names = _globals_in(path, what)
    allowed = {n: _resolve(n) for n in names}
    refused = [n for n, obj in allowed.items() if obj is None]
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise ModelFileError(
            f"{path}: refused: loading it would call {refused[0]}{more}, which is not part of a mace-torch "
            f"model and could run code; if you trust the file's source, {trust_hint}"
        )
    try:
        # all the special names too: numpy's dtype classes are reached without a name in the file
        allowed = {**_special_globals(), **allowed}
        with torch.serialization.safe_globals([(obj, n) for n, obj in allowed.items()]):
            return torch.load(path, map_location=map_location, weights_only=True)
    except ModelFileError as exc:  # raised by the graph-module stand-in, which does not know the path
        raise ModelFileError(f"{path}: refused: {exc}") from None
    except Exception as exc:
        raise _not_readable(path, f"{type(exc).__name__}: {str(exc)[:160]}", what) from None


def load_model(path: str | os.PathLike, *, trust: bool = False, map_location: Any = "cpu") -> torch.nn.Module:
    """A mace-torch model saved with ``torch.save`` (e.g. ``runs/<name>/model.model``), loaded
    safely (:func:`load_torch_file`); a file holding anything else raises, naming it."""
    model = load_torch_file(path, trust=trust, map_location=map_location)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "atomic_numbers") or not hasattr(model, "r_max"):
        raise ModelFileError(f"{path}: a {type(model).__name__}, not a mace-torch model (no atomic_numbers / r_max)")
    return model


# -- torch.fx graph modules, rebuilt from their source without executing it

#: functions the contraction graphs call (opt_einsum_fx output), by the name their source uses
_FX_FUNCTIONS = {
    "torch.functional.tensordot": torch.functional.tensordot,
    "torch.functional.einsum": torch.functional.einsum,
    "torch.tensordot": torch.tensordot,
    "torch.einsum": torch.einsum,
    "torch.mul": torch.mul,
    "torch.add": torch.add,
}
_FX_METHODS = ("permute", "reshape", "transpose", "contiguous", "mul", "view")
_FX_BINOPS = {ast.Mult: operator.mul, ast.Add: operator.add, ast.Sub: operator.sub, ast.Div: operator.truediv}


class _Unsupported(ValueError):
    pass


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise _Unsupported(ast.unparse(node)[:60])


def _fx_value(node: ast.expr, env: dict[str, Any]) -> Any:
    """A call argument: a graph value by name, a tuple or list of arguments, or a literal."""
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise _Unsupported(f"unknown name {node.id}")
        return env[node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_fx_value(e, env) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise _Unsupported(ast.unparse(node)[:60]) from None


def _fx_node(graph: torch.fx.Graph, node: ast.expr, env: dict[str, Any]) -> torch.fx.Node:
    """One graph node for an allowlisted call or arithmetic expression."""
    if isinstance(node, ast.BinOp) and type(node.op) in _FX_BINOPS:
        args = (_fx_value(node.left, env), _fx_value(node.right, env))
        return graph.call_function(_FX_BINOPS[type(node.op)], args)
    if not isinstance(node, ast.Call) or any(k.arg is None for k in node.keywords):
        raise _Unsupported(ast.unparse(node)[:60])
    args = tuple(_fx_value(a, env) for a in node.args)
    kwargs = {k.arg: _fx_value(k.value, env) for k in node.keywords}
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in env:
        if func.attr not in _FX_METHODS:
            raise _Unsupported(f"method {func.attr}")
        return graph.call_method(func.attr, (env[func.value.id], *args), kwargs)
    name = _dotted(func)
    if name not in _FX_FUNCTIONS:
        raise _Unsupported(f"function {name}")
    return graph.call_function(_FX_FUNCTIONS[name], args, kwargs)


def _graph_from_code(code: str) -> torch.fx.Graph:
    """The graph of a ``def forward(self, ...)`` made of ``name = call(...)`` lines and a return."""
    tree = ast.parse(code)
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef) or tree.body[0].name != "forward":
        raise _Unsupported("not a single forward function")
    fn = tree.body[0]
    a = fn.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults or fn.decorator_list:
        raise _Unsupported("forward's signature")
    if not a.args or a.args[0].arg != "self":
        raise _Unsupported("forward without self")
    graph = torch.fx.Graph()
    env: dict[str, Any] = {arg.arg: graph.placeholder(arg.arg) for arg in a.args[1:]}
    for stmt in fn.body:
        if isinstance(stmt, ast.Return) and stmt.value is not None:
            graph.output(_fx_value(stmt.value, env))
            return graph
        if not isinstance(stmt, ast.Assign) or not all(isinstance(t, ast.Name) for t in stmt.targets):
            raise _Unsupported(ast.unparse(stmt)[:60])
        if isinstance(stmt.value, ast.Constant) and stmt.value.value is None:
            continue  # "x = y = None": fx releasing values it no longer needs
        if len(stmt.targets) != 1:
            raise _Unsupported("chained assignment")
        env[stmt.targets[0].id] = _fx_node(graph, stmt.value, env)
    raise _Unsupported("no return")


def _graph_module_from_body(body: dict, import_block: str) -> torch.fx.GraphModule:
    """Stands in for ``torch.fx.graph_module.reduce_graph_module``: the same module, rebuilt from
    the source's syntax tree rather than by executing it (``import_block`` is ignored)."""
    code = (body.get("_code") or body.get("code")) if isinstance(body, dict) else None
    if not isinstance(code, str):
        raise ModelFileError("a torch.fx graph module without its source")
    if body.get("_modules") or body.get("_parameters") or body.get("_buffers"):
        raise ModelFileError("a torch.fx graph module with submodules or tensors of its own")
    try:
        graph = _graph_from_code(code)
    except (_Unsupported, SyntaxError) as exc:
        raise ModelFileError(
            f"a torch.fx graph module whose code is more than tensordot/einsum ({str(exc)[:80]}); "
            "load it only if you trust its source, with --trust-model"
        ) from None
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    gm.train(bool(body.get("training", False)))
    return gm
