"""Generate the text of typed logging hooks from a module's call signature.

TorchScript compiles forward hooks against the module: the hook's ``input``
argument must be typed as the tuple of the forward's argument types, and
its ``output`` as the forward's return type. So each hook is generated from
a *shape*: the types of the positional arguments (from the forward's
annotations, else from the call seen in an example forward, else
``Tensor`` as TorchScript assumes) and of the output (annotation, else
observation, else ``Tensor``).

A generated hook has a typed body that TorchScript compiles, which unpacks
the value statically and taps each tensor, and, under
``if not torch.jit.is_scripting():``, a call into :mod:`picklehooks._hookrt`
that handles any structure at run time. Both give the same record paths.
The text depends only on the shape, the capture flags and the parameter and
buffer names, never on the module's name (it lives on the module as
``_picklehooks_name``), so N modules share a few hooks.

Limits: types the typed body can't unpack (namedtuples, dataclasses,
``Tuple[X, ...]``, non-``str`` dict keys) are passed through untouched under
TorchScript; a module without any describable shape gets an unannotated
hook that works everywhere except TorchScript.
"""

from __future__ import annotations

import keyword
import typing
from typing import Any

import torch

# The typed body must name paths exactly as the run-time body does.
from .._hookrt import _join
from .._ops import COUNTED, GRAD, GUARD, PARAM_GRAD, VALUE

#: Flags that keep a hook from skipping its work while nothing records.
ALWAYS = GUARD

# A shape is a small tree: ("T",) tensor, ("N",) None, ("X", "int") other
# scalar, ("O", inner) optional, ("U", [items]) tuple, ("L", inner) list,
# ("D", inner) dict with str keys. None means "can't describe".
Shape = tuple

_SCALARS = {int: "int", float: "float", bool: "bool", str: "str"}


def shape_from_hint(hint: Any) -> Shape | None:
    """Shape of a type annotation, or None if TorchScript-typed unpacking can't handle it."""
    if hint is torch.Tensor:
        return ("T",)
    if hint in _SCALARS:
        return ("X", _SCALARS[hint])
    if hint is type(None) or hint is None:
        return ("N",)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = shape_from_hint(rest[0])
            return None if inner is None else ("O", inner)
        return None
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return None
        items = [shape_from_hint(a) for a in args if a != ()]
        return None if any(i is None for i in items) else ("U", items)
    if origin is list and len(args) == 1:
        inner = shape_from_hint(args[0])
        return None if inner is None else ("L", inner)
    if origin is dict and len(args) == 2 and args[0] is str:
        inner = shape_from_hint(args[1])
        return None if inner is None else ("D", inner)
    return None


def shape_from_value(value: Any) -> Shape | None:
    """Shape of a value seen in an example forward."""
    if isinstance(value, torch.Tensor):
        return ("T",)
    if value is None:
        return ("N",)
    if type(value) in _SCALARS:
        return ("X", _SCALARS[type(value)])
    if type(value) is tuple:
        items = [shape_from_value(v) for v in value]
        return None if any(i is None for i in items) else ("U", items)
    if type(value) is list and value and all(isinstance(v, torch.Tensor) for v in value):
        return ("L", ("T",))
    if type(value) is dict and value and all(type(k) is str and isinstance(v, torch.Tensor) for k, v in value.items()):
        return ("D", ("T",))
    return None


def annotation(shape: Shape) -> str:
    tag = shape[0]
    if tag == "T":
        return "torch.Tensor"
    if tag == "N":
        return "None"
    if tag == "X":
        return shape[1]
    if tag == "O":
        return f"Optional[{annotation(shape[1])}]"
    if tag == "U":
        return f"Tuple[{', '.join(annotation(s) for s in shape[1])}]" if shape[1] else "Tuple[()]"
    if tag == "L":
        return f"List[{annotation(shape[1])}]"
    return f"Dict[str, {annotation(shape[1])}]"


def _attribute(name: str) -> str:
    """``module.<name>``, or ``getattr(module, '<name>')`` for a name that is no identifier (a ParameterList's "0");
    a dotted name (``"ws.0"``, a parameter of a child ``ParameterList``) reads each part in turn."""
    expr = "module"
    for part in name.split("."):
        expr = f"{expr}.{part}" if part.isidentifier() and not keyword.iskeyword(part) else f"getattr({expr}, {part!r})"
    return expr


def _by_owner(names: tuple) -> list[tuple[str, list[str]]]:
    """``(module-name expression, names there)`` per owner of ``names``: the hooked module's own first, then
    each child's dotted ones (``"ws.0"``: ``"0"`` of child ``ws``, named as :func:`picklehooks._hookrt.pre`
    names it). The expression is TorchScript, reading the hooked module's ``name``."""
    groups: dict[str, list[str]] = {}
    for n in names:
        child, _, leaf = n.rpartition(".")
        groups.setdefault(child, []).append(n)
    return [("name" if not child else f"(name + {'.' + child!r} if name != '' else {child!r})",
             members) for child, members in groups.items()]


class _Emitter:
    """Writes the typed (TorchScript) body that taps every tensor in a value."""

    def __init__(self, kind: str, flags: int) -> None:
        self.kind, self.flags = kind, flags
        self.lines: list[str] = []
        self.count = 0

    def var(self) -> str:
        self.count += 1
        return f"v{self.count}"

    @property
    def carries_grad(self) -> bool:
        """Whether tensors must go through the ``tap`` op (so the model gets its copies)."""
        return bool(self.flags & (GRAD | GUARD))

    def tap_expr(self, expr: str, path_expr: str, indent: str) -> str:
        """Append the ``record`` statement for ``expr``; return what the model gets in its place.

        As :func:`picklehooks._hookrt._traced_tap`: ``expr`` itself unless a gradient is wanted.
        """
        flags = self.flags
        if flags & VALUE:
            self.lines.append(f"{indent}torch.ops.picklehooks.record({expr}, name, {self.kind!r}, {path_expr}, {flags})")
            flags = (flags & ~VALUE) | COUNTED
        if not self.carries_grad:
            return expr
        tap = f"torch.ops.picklehooks.tap({expr}, name, {self.kind!r}, {path_expr}, {flags})"
        if flags & COUNTED and not flags & GUARD:
            # Counted by record, checked by no guard: the tap only carries a gradient, and none
            # can flow back to a value that doesn't require grad (a no_grad forward).
            return f"({tap} if {expr}.requires_grad else {expr})"
        return tap

    def emit(self, shape: Shape, expr: str, path: str, indent: str) -> str:
        """Append lines tapping ``expr``; return the variable (or expression) holding what the model gets."""
        tag = shape[0]
        if tag == "T":
            tapped = self.tap_expr(expr, repr(path), indent)
            if tapped == expr:
                return expr
            v = self.var()
            self.lines.append(f"{indent}{v} = {tapped}")
            return v
        if tag == "O":
            v = self.var()
            self.lines.append(f"{indent}{v} = {expr}")
            self.lines.append(f"{indent}if {v} is not None:")
            inner = self.emit(shape[1], v, path, indent + "    ")
            self.lines.append(f"{indent}    {v} = {inner}")
            return v
        if tag == "U":
            parts = [self.emit(s, f"{expr}[{i}]", _join(path, i), indent) for i, s in enumerate(shape[1])]
            return "(" + "".join(p + ", " for p in parts) + ")"
        if tag in ("L", "D") and shape[1] == ("T",):
            v, item = self.var(), self.var()
            prefix = repr(path + "/") if path else "''"
            if tag == "L":
                container, loop, key = "List[torch.Tensor], []", f"range(len({expr}))", f"str({item})"
            else:
                container, loop, key = "Dict[str, torch.Tensor], {}", f"{expr}.keys()", item
            if self.carries_grad:
                self.lines.append(f"{indent}{v} = torch.jit.annotate({container})")
            self.lines.append(f"{indent}for {item} in {loop}:")
            tapped = self.tap_expr(f"{expr}[{item}]", f"{prefix} + {key}", indent + "    ")
            if not self.carries_grad:
                return expr
            store = f"{v}.append({tapped})" if tag == "L" else f"{v}[{item}] = {tapped}"
            self.lines.append(f"{indent}    {store}")
            return v
        return expr  # scalars, None and what we can't unpack pass through


_HEADER = (
    "import torch\n"
    "from typing import Dict, List, Optional, Tuple\n"
    "import picklehooks._hookrt as _rt\n"
)


def _below_arg(below: tuple) -> str:
    """The trailing ``below`` argument of ``pre``/``pre_kw``: written only where there is one, so
    that every other hook's text (and so its name, shared by modules alike) stays as it was."""
    return f", {below!r}" if below else ""


def pre_hook_text(inputs: list[Shape] | None, flags: int, state_flags: int, params: tuple, buffers: tuple,
                  below: tuple = ()) -> str:
    """Text of a forward pre-hook: tap inputs, record params/buffers.

    ``below``: dotted names of descendants' parameters whose ``param_grad`` it watches too (see
    :func:`picklehooks.capture.watchers.below`); the typed body watches them at every
    call, as it does the module's own.
    """
    generic = f"_rt.pre(module, inputs, {flags}, {state_flags}, {params!r}, {buffers!r}{_below_arg(below)})"
    if inputs is None:
        return _untyped("picklehooks_pre", "module, inputs", generic)
    sig = f"module: torch.nn.Module, inputs: {annotation(('U', inputs))}"
    em = _Emitter("input", flags)
    body = ["    name = module._picklehooks_name"]
    values = [f"inputs[{i}]" for i in range(len(inputs))]
    for kind, all_names in (("param", params), ("buffer", buffers)):
        for owner, names in _by_owner(all_names) if state_flags & VALUE else ():
            # Annotated: TorchScript types e.g. Conv2d.bias as Tensor?, and lists are invariant.
            refs = f"torch.jit.annotate(List[Optional[torch.Tensor]], [{', '.join(_attribute(n) for n in names)}])"
            leaves = ",".join(n.rpartition(".")[2] for n in names)
            em.lines.append(f"    torch.ops.picklehooks.record_state({refs}, {owner}, {kind!r}, {leaves!r}, "
                            f"{state_flags})")
    for owner, names in _by_owner(params) + _by_owner(below) if state_flags & PARAM_GRAD else ():
        # The op's kernel attaches gradient hooks to the parameters themselves.
        refs = ", ".join(_attribute(n) for n in names)
        leaves = ",".join(n.rpartition(".")[2] for n in names)
        em.lines.append(f"    torch.ops.picklehooks.watch(torch.jit.annotate(List[Optional[torch.Tensor]], [{refs}]), "
                        f"{owner}, {leaves!r}, {state_flags})")
    if flags:
        values = [em.emit(s, values[i], str(i), "    ") for i, s in enumerate(inputs)]
    ret = "(" + "".join(v + ", " for v in values) + ")"
    return _typed("picklehooks_pre", sig, annotation(("U", inputs)), generic, body + em.lines, ret, flags,
                  idle_ret="inputs")


def keyword_pre_hook_text(flags: int, state_flags: int, params: tuple, buffers: tuple, below: tuple = ()) -> str:
    """Text of a ``with_kwargs=True`` forward pre-hook: positional and keyword inputs, params/buffers.

    Every form but TorchScript calls it (TorchScript compiles pre-hooks as
    ``(module, input)`` only, so ``instrument(scriptable=True)`` uses
    :func:`pre_hook_text` instead). ``below``: as for :func:`pre_hook_text`.
    """
    generic = (f"_rt.pre_kw(module, args, kwargs, {flags}, {state_flags}, {params!r}, {buffers!r}"
               f"{_below_arg(below)})")
    return _untyped("picklehooks_pre_kw", "module, args, kwargs", generic)


def forward_hook_text(inputs: list[Shape] | None, output: Shape | None, flags: int, eager_flags: int = 0) -> str:
    """Text of a forward hook: tap every tensor in the output.

    ``eager_flags``: bits only the run-time body gets (``INPUT_GRAD``).
    """
    generic = f"_rt.forward(module, output, {flags | eager_flags}, inputs)"
    if inputs is None or output is None:
        return _untyped("picklehooks_forward", "module, inputs, output", generic)
    sig = f"module: torch.nn.Module, inputs: {annotation(('U', inputs))}, output: {annotation(output)}"
    em = _Emitter("output", flags)
    result = em.emit(output, "output", "", "    ")
    return _typed("picklehooks_forward", sig, annotation(output), generic,
                  ["    name = module._picklehooks_name"] + em.lines, result, flags,
                  idle_ret="output")


def unscriptable_text(name: str, cls: str) -> str:
    """Text of a module's ``__prepare_scriptable__``, which ``torch.jit.script`` calls first: it
    raises, naming the module and the fix (only what the hooks' own text needs: no picklehooks)."""
    message = (f"picklehooks: {name!r} ({cls}) has an overloaded forward, and TorchScript can't compile "
               "hooks on such a module; instrument the model with instrument(..., scriptable=True) "
               "(which leaves such modules out), or remove() the instrumentation, before torch.jit.script")
    return f"def picklehooks_unscriptable():\n    raise RuntimeError({message!r})\n"


def range_hook_texts(inputs: list[Shape] | None, output: Shape | None) -> tuple[str, str]:
    """Texts of ``profile=True``'s pre-hook (opens the range) and forward hook (closes it).

    Typed only when the range can ride on a top-level tensor both ways in (a
    tensor argument) and out (the output, or a tensor in an output tuple);
    other modules get untyped hooks, which time them everywhere but TorchScript.
    """
    enter_generic, exit_generic = "_rt.range_pre(module, inputs)", "_rt.range_post(module, output)"
    first_in = next((i for i, s in enumerate(inputs or []) if s == ("T",)), None)
    if output == ("T",):
        first_out = None
    elif output is not None and output[0] == "U":
        first_out = next((i for i, s in enumerate(output[1]) if s == ("T",)), None)
    else:
        first_out = -1
    if inputs is None or first_in is None or first_out == -1:
        return (_untyped("picklehooks_range_enter", "module, inputs", enter_generic),
                _untyped("picklehooks_range_exit", "module, inputs, output", exit_generic))
    in_type = annotation(("U", inputs))
    values = [f"inputs[{i}]" for i in range(len(inputs))]
    values[first_in] = "v1"
    enter = _typed("picklehooks_range_enter", f"module: torch.nn.Module, inputs: {in_type}", in_type, enter_generic,
                   ["    v1 = torch.ops.picklehooks.range_enter(inputs[%d], module._picklehooks_name)" % first_in],
                   "(" + "".join(v + ", " for v in values) + ")", ALWAYS)
    if first_out is None:
        body, ret = ["    v1 = torch.ops.picklehooks.range_exit(output, module._picklehooks_name)"], "v1"
    else:
        items = [f"output[{i}]" for i in range(len(output[1]))]
        items[first_out] = "v1"
        body = [f"    v1 = torch.ops.picklehooks.range_exit(output[{first_out}], module._picklehooks_name)"]
        ret = "(" + "".join(v + ", " for v in items) + ")"
    exit_ = _typed("picklehooks_range_exit", f"module: torch.nn.Module, inputs: {in_type}, output: {annotation(output)}",
                   annotation(output), exit_generic, body, ret, ALWAYS)
    return enter, exit_


def _typed(fn: str, sig: str, ret_type: str, generic: str, body: list[str], ret: str, flags: int,
           idle_ret: str | None = None) -> str:
    """A hook with a run-time body (everywhere but TorchScript) and a typed one (TorchScript).

    ``idle_ret``: what the typed body returns at once while nothing records
    (the ``active`` op costs about 0.16 µs above an empty scripted function with
    its C kernel, 0.8 µs with its Python one; each recording op much more).
    """
    idle = ("" if idle_ret is None or flags & ALWAYS else
            f"    if not torch.ops.picklehooks.active({flags}):\n        return {idle_ret}\n")
    # The run-time body skips its own work while nothing records (see _hookrt.skip).
    return (
        _HEADER
        + f"def {fn}({sig}) -> {ret_type}:\n"
        + "    if not torch.jit.is_scripting():\n"
        + f"        return {generic}\n"
        + idle
        + "".join(line + "\n" for line in body)
        + f"    return {ret}\n"
    )


def _untyped(fn: str, sig: str, generic: str) -> str:
    """A hook with the run-time body only (it skips its own work while nothing records)."""
    return (
        "import picklehooks._hookrt as _rt\n"
        f"def {fn}({sig}):\n"
        f"    return {generic}\n"
    )
