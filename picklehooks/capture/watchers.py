"""Which generated pre-hook reads, and watches the gradients of, which parameters.

A module's pre-hook reads its own parameters and those of a chosen child
that is never called (``ParameterList``, ``ParameterDict``) at its call, and
watches their ``param_grad``. In a model loaded where ``instrument()``'s own
gradient hooks aren't (another process, a saved graph), that is the only
place they get watched, so a module that never runs would lose its
``param_grad``: :func:`below` has its nearest hooked ancestor watch them too.
"""

from __future__ import annotations

from torch import nn


def own(module: nn.Module) -> list[str]:
    """The names of ``module``'s own parameters (``None`` entries, such as a missing bias, left out)."""
    return [n for n, p in module.named_parameters(recurse=False) if p is not None]


def read_at_call(module: nn.Module, name: str, chosen: dict[str, nn.Module]) -> tuple[str, ...]:
    """The parameters ``module``'s pre-hook records and watches: its own, then those of each chosen
    child that is never called (a ParameterList: ``"ws.0"`` is parameter ``"0"`` of child ``"ws"``,
    recorded under the child's name, as ``instrument()`` names its ``param_grad``)."""
    return (*own(module), *(f"{attr}.{n}" for attr, child in module.named_children()
                            if type(child).forward is nn.Module.forward
                            and (f"{name}.{attr}" if name else attr) in chosen for n in own(child)))


def below(chosen: dict[str, nn.Module], hooked: set[str], observed: dict) -> dict[str, tuple[str, ...]]:
    """``{hooked module: dotted names of descendants' parameters}`` whose ``param_grad`` its pre-hook
    watches as well (``"rel_pos.table"``: ``table`` of child ``rel_pos``, recorded under
    ``"<module>.rel_pos"``).

    A parameter is listed where the pre-hook that reads it (:func:`read_at_call`) may never run:
    MaxViT reads its relative-position modules through ``get_bias()`` and MultiheadAttention reads
    ``out_proj``'s weight, without calling them; a module left without hooks has none. It goes to
    the nearest hooked ancestor of that module, which runs wherever the parameter is used inside
    it. Only the nearest: each parameter gets at most one more watch. And only where it may be
    needed: with ``example_inputs``, not for a module the example forward ran (it watches its
    own), so a model whose modules all ran keeps exactly the hooks it had. A watch is kept per
    (parameter, module, name): a module that runs after all still records once. The ancestor
    watches them once per process in eager mode, at every call in a graph (see
    :func:`picklehooks._hookrt._watch_below`). Not covered: a module without a hooked ancestor
    (a never-run child of an unchosen root), or whose nearest hooked ancestor never runs either.
    """
    out: dict[str, list[str]] = {}
    for name, module in chosen.items():
        names = own(module)
        if not names or not name:
            continue  # nothing to watch, or the root: no ancestor
        parent = name.rpartition(".")[0]
        if name in hooked:
            reader = name
        elif type(module).forward is nn.Module.forward and parent in hooked:
            reader = parent  # a ParameterList, read at its owner's call (see read_at_call)
        else:
            reader = None  # left without hooks
        if reader is not None and reader in observed:
            continue  # ran in the example forward
        ancestor = next((a for a in _ancestors(name if reader is None else reader) if a in hooked), None)
        if ancestor is not None:
            rel = name[len(ancestor) + 1:] if ancestor else name
            out.setdefault(ancestor, []).extend(f"{rel}.{n}" for n in names)
    return {a: tuple(names) for a, names in out.items()}


def _ancestors(name: str):
    """The qualified names above ``name``, nearest first, the root (``""``) last."""
    while name:
        name = name.rpartition(".")[0]
        yield name
