"""Linear layers of the block engine, with a [in, out] weight copy on CPU.

PyTorch-on-CPU adapter. `nn.Linear` keeps its weight [out, in] and multiplies by its transpose;
with MKL (PyTorch 2.x, AVX-512, 1 thread) that layout is slow for the few rows a decoder pass
has. A contiguous [in, out] copy multiplied with `addmm` measured 20-50% faster for 1-64 rows on
this project's CPU (d=256: the 8000-word vocabulary projection of 8 rows 937 -> 456 us, of 33 rows
1306 -> 995 us; a 256x1024 feed-forward product of 8 rows 58 -> 27 us). The result is the same
product summed in another order, so it equals fairseq's to float rounding, as any change of batch
shape already does. The copy costs one more copy of each weight used (decoder layers and output
projection); it is made on first use and made again when the weight changes (its version counter
or storage). On other devices, and whenever autograd may need the weight, `nn.Linear` runs as is.
"""

from __future__ import annotations

import weakref
from typing import Tuple

import torch
from torch import Tensor, nn

_COPIES: weakref.WeakKeyDictionary[nn.Linear, Tuple[int, int, Tensor]] = weakref.WeakKeyDictionary()


def _plain(module: nn.Module) -> bool:
    return type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks


def _transposed(module: nn.Linear) -> Tensor:
    w = module.weight
    key = (w._version, w.data_ptr())
    hit = _COPIES.get(module)
    if hit is None or hit[:2] != key or hit[2].dtype != w.dtype:
        hit = (*key, w.detach().t().contiguous())
        _COPIES[module] = hit
    return hit[2]


def linear(module: nn.Module, x: Tensor) -> Tensor:
    """`module(x)` for an `nn.Linear`: on CPU at inference, the product with the cached [in, out]
    copy of its weight; otherwise the module itself."""
    w = getattr(module, "weight", None)
    if (w is None or not _plain(module) or w.device.type != "cpu" or x.dtype != w.dtype
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
        return module(x)
    flat = x.reshape(-1, x.size(-1))
    wt = _transposed(module)  # type: ignore[arg-type]
    out = torch.mm(flat, wt) if module.bias is None else torch.addmm(module.bias, flat, wt)
    return out.view(*x.shape[:-1], wt.size(1))
