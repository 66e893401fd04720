"""The replay proof's comparison (checkpoint/compare.py): bit for bit, else a relative
difference that rounding stays within and a lost state does not."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from steadfast.checkpoint.compare import DEFAULT_TOLERANCE, difference, same


def test_equal_values_are_exact() -> None:
    t = torch.randn(100)
    state = {"w": t, "step": 3, "rng": random.getstate(), "np": np.random.get_state()}
    again = {"w": t.clone(), "step": 3, "rng": random.getstate(), "np": np.random.get_state()}
    assert difference(state, again) == 0.0 and same(state, again)
    assert difference(float("nan"), float("nan")) == 0.0  # a NaN loss logged and re-done


def test_a_rounding_is_a_small_relative_difference() -> None:
    a = 0.18584975600242615
    b = 0.18584974110126495  # steadfast demo --nproc 4: DDP's bucket order after a restart
    assert 0 < difference(a, b) < 1e-7 < DEFAULT_TOLERANCE
    t = torch.randn(1000, dtype=torch.float32)
    ulp = torch.nextafter(t, torch.full_like(t, math.inf))  # every element one ulp up
    assert 0 < difference(t, ulp) < 1e-6 and not same(t, ulp)


def test_an_element_near_zero_does_not_make_a_tensor_differ() -> None:
    """Relative to the tensor's norm: a rounding in an element of 1e-12 is not 100 %."""
    t = torch.tensor([1.0, 2.0, 1e-12], dtype=torch.float64)
    u = t.clone()
    u[2] = 2e-12
    assert difference(t, u) < 1e-11


def test_what_is_not_rounding_differs_without_bound() -> None:
    t = torch.randn(10)
    assert difference(t, t.double()) == math.inf  # a dtype
    assert difference(t, t[:5]) == math.inf  # a shape
    assert difference(torch.arange(4), torch.arange(4) + 1) == math.inf  # integers
    assert difference({"a": 1}, {"b": 1}) == math.inf  # keys
    assert difference(1.0, float("nan")) == math.inf
    assert difference(random.getstate(), random.Random(1).getstate()) == math.inf
    assert difference(t, t * 1.01) > DEFAULT_TOLERANCE  # a learning rate 1 % off
