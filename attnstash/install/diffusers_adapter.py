"""What the installer needs to know of diffusers (checked on 0.42.1, every transformer model
class it builds: `make sweep`).

Layers: the blocks a diffusers model checkpoints. Every module with a `gradient_checkpointing`
attribute (the model, and modules inside it that checkpoint blocks of their own: nested
Transformer2DModels, token refiners) calls `self._gradient_checkpointing_func(block, *args)`
inside loops over its ModuleLists; which collections those are is read from the class's source
(the loop that binds the block: `for block in self.transformer_blocks`, `zip(...)`, `enumerate(...)`,
nested loops, a local alias). A block has attention if it holds a diffusers attention module or
a module class whose code calls F.scaled_dot_product_attention (found.calls_any). The default checkpoint function
checkpoints the block's module call (MODULE_CALL). The structure lists the blocks that could be
checkpointed (listed_blocks); those the reading leaves out are checked by what runs (unread.py).
"""
import ast
import functools
import inspect
import sys
import textwrap

import torch

from . import torch_adapter
from .found import Found, MODULE_CALL, calls_any

CALL = "_gradient_checkpointing_func"
_ANY = "*"  # a path step: every item of the collection


def find(model):
    """[core.Found] for a diffusers model, or None if it is not one or checkpoints no blocks."""
    if not _is_diffusers(model):
        return None
    names = {id(m): name for name, m in model.named_modules()}
    blocks = {}
    for owner in model.modules():
        if not hasattr(owner, "gradient_checkpointing") or owner is None:
            continue
        for path in checkpointed_paths(type(owner)):
            for block in _resolve(owner, path):
                if isinstance(block, torch.nn.Module):
                    blocks[id(block)] = block
    order = {id(m): i for i, m in enumerate(model.modules())}
    found = [Found(b, names.get(id(b), ""), has_attention(b), MODULE_CALL)
             for b in sorted(blocks.values(), key=lambda b: order.get(id(b), 0))]
    return found or None


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def listed_blocks(model):
    """{id: (name, block)} of the blocks with attention that a diffusers model's checkpointing
    modules (those with a `gradient_checkpointing` attribute) hold in their module lists, dicts or
    Sequentials (nested ones too), innermost (a block holding another such block is not one): the
    blocks the model could checkpoint, from its structure alone. A superset of find's with
    attention on every class of `make sweep` (tests/python/diffusers_blocks.py); those find leaves
    out are the ones a model runs outside its checkpoints (Lumina2's refiners, UNetMotion's motion
    modules), which the installer watches (install/unread.py). {} for a model that is not a
    diffusers one."""
    if not _is_diffusers(model):
        return {}
    held = {}
    for owner in model.modules():
        if hasattr(owner, "gradient_checkpointing"):
            for child in owner.children():
                if isinstance(child, _CONTAINERS):
                    held.update((id(b), b) for b in _items(child) if has_attention(b))
    names = {id(m): name for name, m in model.named_modules()}
    return {key: (names.get(key, ""), b) for key, b in held.items()
            if not any(id(m) in held for m in b.modules() if m is not b)}


def _items(container):
    for item in (container.values() if isinstance(container, torch.nn.ModuleDict) else container):
        if isinstance(item, _CONTAINERS):
            yield from _items(item)
        elif isinstance(item, torch.nn.Module):
            yield item


def _is_diffusers(model):
    """Whether a model is (or holds) a diffusers model: one of its modules a ModelMixin."""
    diffusers = sys.modules.get("diffusers")
    return diffusers is not None and any(isinstance(m, diffusers.ModelMixin) for m in model.modules())


def describe(model):
    return ("diffusers blocks that a model's forward checkpoints (self._gradient_checkpointing_func(block, ...) in a "
            "loop over its ModuleLists)")


def has_attention(block):
    """Whether a block holds attention: a diffusers attention module (whatever its processor), a
    module with a processor that calls attention, or a module class that calls
    F.scaled_dot_product_attention."""
    diffusers = sys.modules.get("diffusers")
    kinds = tuple(k for k in (_attr(diffusers, "models.attention_processor.Attention"),
                              _attr(diffusers, "models.attention.AttentionModuleMixin")) if k is not None)
    return any(isinstance(m, kinds) or _processor_attends(getattr(m, "processor", None))
               for m in block.modules()) or torch_adapter.has_attention(block)


@functools.lru_cache(maxsize=None)
def _processor_class_attends(cls):
    return calls_any(cls, ("scaled_dot_product_attention", "dispatch_attention_fn"))


def _processor_attends(processor):
    return processor is not None and _processor_class_attends(type(processor))


def _attr(root, dotted):
    for part in dotted.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def _resolve(owner, path):
    items = [owner]
    for step in path:
        nxt = []
        for item in items:
            if step == _ANY:
                nxt.extend(item.values() if isinstance(item, torch.nn.ModuleDict) else
                           item if isinstance(item, (torch.nn.ModuleList, torch.nn.Sequential, list, tuple)) else [])
            elif isinstance(step, int) and isinstance(item, (torch.nn.ModuleList, torch.nn.Sequential, list, tuple)):
                if -len(item) <= step < len(item):
                    nxt.append(item[step])
            elif (isinstance(step, str) and isinstance(item, torch.nn.Module)
                  and not isinstance(item, torch.nn.ModuleDict)):
                value = getattr(item, step, None)
                if value is not None:
                    nxt.append(value)
            elif isinstance(item, (torch.nn.ModuleDict, dict)) and step in item:
                nxt.append(item[step])
        items = nxt
    return items


# ---- reading the class's source ------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def source_of(klass):
    """A class's source ("" where there is none: a class made at run time)."""
    try:
        return inspect.getsource(klass)
    except (OSError, TypeError):
        return ""


@functools.lru_cache(maxsize=None)
def checkpointed_paths(cls):
    """The attribute paths (tuples of names, keys and _ANY) of the blocks a class's methods pass
    to self._gradient_checkpointing_func, from its source and its diffusers base classes'."""
    paths = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("diffusers") or CALL not in source_of(klass):
            continue
        tree = ast.parse(textwrap.dedent(source_of(klass)))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for call in ast.walk(tree):
            if _is_checkpoint_call(call) and call.args:
                path = _block_path(call.args[0], call, parents)
                if path is not None:
                    paths.add(path)
    return frozenset(paths)


def _is_checkpoint_call(node):
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == CALL
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")


def _block_path(expr, at, parents):
    if isinstance(expr, ast.Attribute) and expr.attr == "__call__":  # block.__call__
        expr = expr.value
    if isinstance(expr, ast.Starred):
        return None
    return _path(expr, at, parents)


def _path(expr, at, parents):
    """The attribute path `expr` names, seen from node `at` (for loop variables and locals)."""
    if isinstance(expr, ast.Name):
        if expr.id == "self":
            return ()
        return _bound(expr.id, at, parents)
    if isinstance(expr, ast.Attribute):
        base = _path(expr.value, at, parents)
        return None if base is None else base + (expr.attr,)
    if isinstance(expr, ast.Subscript):
        base = _path(expr.value, at, parents)
        if base is None:
            return None
        key = expr.slice
        if isinstance(key, ast.Slice):  # a slice of a collection is that collection, or part of it
            return base
        if isinstance(key, ast.Constant) and isinstance(key.value, (str, int)):
            return base + (key.value,)
        return base + (_ANY,)  # an index that cannot be read: take every item
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("list", "reversed",
                                                                                              "tuple") and expr.args:
        return _path(expr.args[0], at, parents)
    return None


def _bound(name, at, parents):
    """The path of the value `name` holds at `at`: a loop variable (an item of what the loop
    iterates) or a local assigned once before."""
    node = at
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.For, ast.comprehension)):
            source = _item_of(node.target, node.iter, name, node, parents)
            if source is not None:
                return source
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assigned = _assigned(name, node)
            return None if assigned is None else _path(assigned, assigned, parents)
    return None


def _assigned(name, function):
    """The value a function assigns to the local `name` (the first assignment), or None."""
    for stmt in ast.walk(function):
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id == name):
            return stmt.value
    return None


def _function_of(node, parents):
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


def _item_of(target, iterable, name, at, parents):
    """The path of `name` where `for target in iterable` binds it."""
    if isinstance(target, ast.Name):
        if target.id != name:
            return None
        base = _path(iterable, at, parents)
        return None if base is None else base + (_ANY,)
    if not isinstance(target, ast.Tuple):
        return None
    if isinstance(iterable, ast.Name):  # a local bound to zip(...) or enumerate(...) before the loop
        function = _function_of(at, parents)
        iterable = (_assigned(iterable.id, function) if function is not None else None) or iterable
    call = iterable if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) else None
    if call is not None and call.func.id == "enumerate" and len(target.elts) == 2 and call.args:
        return _item_of(target.elts[1], call.args[0], name, at, parents)
    if call is not None and call.func.id == "zip":
        for element, source in zip(target.elts, call.args):
            found = _item_of(element, source, name, at, parents)
            if found is not None:
                return found
    return None
