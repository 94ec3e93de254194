"""generators.common.to_host: one host copy of several tensors gives each back exactly, by name."""

import math

import numpy as np
import torch

from fairseq_streambeam.generators.common import to_host


def test_every_dtype_comes_back_exactly():
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(3, 4, generator=g)
    f32[0, 0], f32[0, 1], f32[0, 2] = -math.inf, math.nan, -0.0
    f64 = torch.randn(5, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 2**40, (2, 3), generator=g)
    mask = torch.rand(4, generator=g) > 0.5
    half = torch.tensor([0.1, -2.5], dtype=torch.float16)
    h = to_host(f32=f32, ids=ids, mask=mask, f64=f64, half=half, empty=torch.zeros(0, dtype=torch.long))
    assert h["f32"].dtype == np.float32 and h["f32"].shape == (3, 4)
    assert np.array_equal(h["f32"].view(np.int32), f32.numpy().view(np.int32))  # bit for bit, NaN and -0.0 too
    assert h["f64"].dtype == np.float64 and np.array_equal(h["f64"], f64.numpy())
    assert h["ids"].dtype == np.int64 and np.array_equal(h["ids"], ids.numpy())
    assert h["mask"].dtype == bool and np.array_equal(h["mask"], mask.numpy())
    assert h["half"].dtype == np.float32 and np.array_equal(h["half"], half.float().numpy())
    assert h["empty"].shape == (0,)
