"""The benchmark state: a transformer's fp32 parameters plus its Adam moments.

`build_state(size_mb)` returns ``{"model": {...}, "optim": {"exp_avg": {...},
"exp_avg_sq": {...}}}``: plain nested dicts of contiguous CPU fp32 tensors of realistic,
varied sizes (token and position embeddings, per block a fused qkv projection, the
attention output projection, the two MLP matrices, their biases and two layer norms,
and a final layer norm). The shapes are a pure function of ``size_mb``, the values a
pure function of ``seed``, so every method in a run (and every run with the same
arguments) sees byte-identical state.

This module imports only torch: it is also imported by the DLRover peer script, which
runs in a separate virtual environment without `resumable`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

FP32 = 4
ADAM_COPIES = 3  # parameters + exp_avg + exp_avg_sq


def _round_to(x: float, multiple: int) -> int:
    return max(multiple, round(x / multiple) * multiple)


def model_shapes(size_mb: float) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a GPT-like model whose parameters plus two Adam moments take
    about ``size_mb`` MiB in fp32. About a quarter of the parameters sit in the token
    embedding, the rest in ``layers`` blocks of ~12 d² each."""
    params = size_mb * 2**20 / (FP32 * ADAM_COPIES)
    target_layers = 12 if params >= 50e6 else 6
    d = _round_to(math.sqrt(0.75 * params / (12 * target_layers)), 64)
    vocab = _round_to(0.25 * params / d, 64)
    ctx = 1024 if d >= 512 else 256
    per_layer = 12 * d * d + 13 * d
    layers = max(1, round((params - (vocab + ctx + 2) * d) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, d), "wpe.weight": (ctx, d)}
    for i in range(layers):
        p = f"h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (d,),
                p + "ln_1.bias": (d,),
                p + "attn.c_attn.weight": (3 * d, d),
                p + "attn.c_attn.bias": (3 * d,),
                p + "attn.c_proj.weight": (d, d),
                p + "attn.c_proj.bias": (d,),
                p + "ln_2.weight": (d,),
                p + "ln_2.bias": (d,),
                p + "mlp.c_fc.weight": (4 * d, d),
                p + "mlp.c_fc.bias": (4 * d,),
                p + "mlp.c_proj.weight": (d, 4 * d),
                p + "mlp.c_proj.bias": (d,),
            }
        )
    shapes["ln_f.weight"] = (d,)
    shapes["ln_f.bias"] = (d,)
    return shapes


def build_state(size_mb: float, seed: int = 0) -> dict[str, Any]:
    """The nested state dict described in the module docstring (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = model_shapes(size_mb)

    def filled(shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).uniform_(lo, hi, generator=gen)

    model = {name: filled(s, -0.05, 0.05) for name, s in shapes.items()}
    exp_avg = {name: filled(s, -1e-3, 1e-3) for name, s in shapes.items()}
    exp_avg_sq = {name: filled(s, 0.0, 1e-6) for name, s in shapes.items()}
    return {"model": model, "optim": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}}


def iter_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted/path, tensor)`` for every tensor of a nested dict, in insertion order."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_tensors(v, f"{prefix}/{k}" if prefix else str(k))


def flat(tree: Any) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(tree))


def nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(tree))


def empty_like_tree(tree: Any) -> Any:
    """Same structure, freshly allocated (and touched, so no page faults later) tensors."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return {k: empty_like_tree(v) for k, v in tree.items()}


def copy_into(dst: Any, src: Any) -> None:
    """``dst.copy_(src)`` for every tensor of ``dst``, matched by path in ``src``."""
    source = flat(src)
    with torch.no_grad():
        for name, d in iter_tensors(dst):
            d.copy_(source[name])


def describe(tree: Any) -> dict[str, Any]:
    sizes = sorted(t.numel() * t.element_size() for _, t in iter_tensors(tree))
    return {
        "bytes": sum(sizes),
        "tensors": len(sizes),
        "dtype": "float32",
        "largest_tensor_bytes": sizes[-1] if sizes else 0,
        "median_tensor_bytes": sizes[len(sizes) // 2] if sizes else 0,
        "smallest_tensor_bytes": sizes[0] if sizes else 0,
    }
