"""A small stand-in for einops' rearrange and repeat, for machines without einops.

run.sh puts this folder on PYTHONPATH only when `import einops` fails, so the
real package wins wherever it is installed. It covers the pattern language that
flash-attn's test file uses, on torch tensors:

    names ("b s h d"), parenthesised groups ("(b s)", "(h g)"), unit axes
    ("1" on either side), one "..." standing for the remaining dimensions, and,
    in repeat, new axes named on the right (sized by a keyword) or given as a
    number inside a group ("(s_256 256)").

Like einops, rearrange returns a view where torch's reshape can give one, and
repeat expands before the final reshape.
"""

import math
import re

__all__ = ["rearrange", "repeat"]

_ELLIPSIS = "..."


def _parse_side(text):
    """'b (s h) 1 ...' -> [['b'], ['s', 'h'], [], ['...']]; a number inside a group stays a str."""
    groups, current = [], None
    for token in re.findall(r"\.\.\.|\(|\)|[A-Za-z_][A-Za-z0-9_]*|\d+", text):
        if token == "(":
            if current is not None:
                raise ValueError(f"nested parentheses in {text!r}")
            current = []
        elif token == ")":
            if current is None:
                raise ValueError(f"unbalanced ')' in {text!r}")
            groups.append(current)
            current = None
        elif current is not None:
            if token == _ELLIPSIS:
                raise ValueError(f"'...' inside parentheses is not supported: {text!r}")
            if token != "1":
                current.append(token)
        elif token.isdigit():
            if token != "1":
                raise ValueError(f"a bare number other than 1 in {text!r}")
            groups.append([])
        else:
            groups.append([token])
    if current is not None:
        raise ValueError(f"unbalanced '(' in {text!r}")
    names = [n for g in groups for n in g if not n.isdigit()]
    if len(names) != len(set(names)):
        raise ValueError(f"an axis is named twice in {text!r}")
    if sum(g == [_ELLIPSIS] for g in groups) > 1:
        raise ValueError(f"more than one '...' in {text!r}")
    return groups


def _split(pattern):
    if pattern.count("->") != 1:
        raise ValueError(f"pattern needs exactly one '->': {pattern!r}")
    left, right = pattern.split("->")
    return _parse_side(left), _parse_side(right)


def _expand_ellipsis(groups, n_extra):
    out = []
    for g in groups:
        if g == [_ELLIPSIS]:
            out += [[f"...{i}"] for i in range(n_extra)]
        else:
            out.append(g)
    return out


def _decompose(tensor, left, sizes):
    """Reshapes tensor to one dim per named axis of the left side; fills sizes."""
    n_fixed = sum(g != [_ELLIPSIS] for g in left)
    has_ellipsis = len(left) != n_fixed
    if (tensor.dim() < n_fixed) if has_ellipsis else (tensor.dim() != n_fixed):
        raise ValueError(f"tensor of {tensor.dim()} dims does not match {len(left)} axis groups")
    left = _expand_ellipsis(left, tensor.dim() - n_fixed)
    axes = []
    for group, dim_size in zip(left, tensor.shape):
        if any(name.isdigit() for name in group):
            raise ValueError(f"a number inside a group on the left side is not supported: {group}")
        if not group:
            if dim_size != 1:
                raise ValueError(f"a unit axis '1' has size {dim_size}")
            continue
        unknown = [n for n in group if n not in sizes]
        known = math.prod(sizes[n] for n in group if n in sizes)
        if len(unknown) > 1:
            raise ValueError(f"cannot infer the sizes of {unknown}: give them as keywords")
        if unknown:
            if known == 0 or dim_size % known:
                raise ValueError(f"cannot split a dim of size {dim_size} into {group}")
            sizes[unknown[0]] = dim_size // known
        elif known != dim_size:
            raise ValueError(
                f"axes {group} of sizes {[sizes[n] for n in group]} do not "
                f"make up the dim of size {dim_size}"
            )
        axes += group
    return tensor.reshape([sizes[n] for n in axes]), axes, left


def _apply(tensor, pattern, sizes, allow_new):
    left, right = _split(pattern)
    sizes = {name: int(size) for name, size in sizes.items()}
    elementary, axes, left = _decompose(tensor, left, sizes)
    right = _expand_ellipsis(right, sum(1 for n in axes if n.startswith("...")))
    right_axes = []
    for group in right:
        for i, name in enumerate(group):
            if name.isdigit():  # "(s 256)": a new axis of that size, for repeat
                group[i] = f"#{len(right_axes)}"
                sizes[group[i]] = int(name)
            right_axes.append(group[i])
    new_axes = [n for n in right_axes if n not in axes]
    missing = [n for n in axes if n not in right_axes]
    if missing:
        raise ValueError(f"axes {missing} of the left side are missing on the right of {pattern!r}")
    if new_axes and not allow_new:
        raise ValueError(f"rearrange cannot create axes {new_axes}; use repeat")
    for name in new_axes:
        if sizes.get(name) is None:
            raise ValueError(f"give the size of the new axis {name!r} as a keyword")
    # Order the existing axes as on the right, then insert the new ones.
    result = elementary.permute([axes.index(n) for n in right_axes if n in axes])
    if new_axes:
        shape = []
        for name in right_axes:
            if name in axes:
                shape.append(sizes[name])
            else:
                result = result.unsqueeze(len(shape))
                shape.append(sizes[name])
        result = result.expand(shape)
    return result.reshape([math.prod(sizes[n] for n in group) for group in right])


def rearrange(tensor, pattern, **axes_lengths):
    """Reorders, splits and merges the dims of a torch tensor (einops.rearrange)."""
    return _apply(tensor, pattern, axes_lengths, allow_new=False)


def repeat(tensor, pattern, **axes_lengths):
    """rearrange that may also create new axes, by repeating the tensor (einops.repeat)."""
    return _apply(tensor, pattern, axes_lengths, allow_new=True)
