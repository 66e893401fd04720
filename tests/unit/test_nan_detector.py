"""NaNDetector / NaNState in one process: the seed's API, defaults, and the extras."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadfast import ConfigError, NaNDetector, NaNState

NAN, INF = float("nan"), float("inf")


def _kinds(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(x)["kind"] for x in path.read_text().splitlines()]


def test_defaults_match_the_seed():
    d = NaNDetector()
    assert (d.action, d.max_consecutive, d.max_history) == ("warn", 5, 100)
    assert d.state == NaNState(0, 0, INF, 0, [])
    assert not d.should_rollback


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"action": "ignore"}, "NaNDetector.action: Invalid NaN action: 'ignore'"),
        ({"max_consecutive": -1}, "NaNDetector.max_consecutive: must be >= 1"),
        ({"max_consecutive": 0}, "NaNDetector.max_consecutive: must be >= 1"),
        ({"max_consecutive": True}, "NaNDetector.max_consecutive: expected an integer"),
        ({"max_history": -5}, "NaNDetector.max_history: must be >= 0"),
    ],
)
def test_bad_arguments_are_one_clear_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        NaNDetector(**kwargs)
    with pytest.raises(ValueError):  # the original raised ValueError; still caught
        NaNDetector(**kwargs)


@pytest.mark.parametrize("loss", [1.5, torch.tensor(1.5), torch.tensor([1.5])])
def test_finite_loss(loss):
    d = NaNDetector()
    assert d.check_loss(loss, step=3) is True
    assert d.state.last_good_loss == 1.5 and d.state.last_good_step == 3


@pytest.mark.parametrize("bad", [NAN, INF, -INF, torch.tensor(NAN), torch.tensor(INF)])
def test_nonfinite_loss_counts_and_events(bad, event_log: Path):
    d = NaNDetector(action="skip", max_consecutive=2)
    assert d.check_loss(2.0, 1)
    assert d.check_loss(bad, 2) is False
    assert (d.state.consecutive_nans, d.state.total_nans, d.state.nan_steps) == (1, 1, [2])
    assert not d.should_rollback
    assert d.check_loss(bad, 3) is False
    assert d.should_rollback
    assert d.state.last_good_step == 1 and d.state.last_good_loss == 2.0
    assert _kinds(event_log) == ["nan_detected", "nan_detected", "nan_rollback_recommended"]
    first = json.loads(event_log.read_text().splitlines()[0])
    assert first["step"] == 2 and first["cause"] == "loss" and first["local"] is True
    assert first["ranks_affected"] == 1 and first["action"] == "skip"
    assert d.check_loss(1.0, 4)  # a good step resets the run, not the total
    assert (d.state.consecutive_nans, d.state.total_nans) == (0, 2)
    assert not d.should_rollback


def test_loss_must_be_a_scalar():
    d = NaNDetector()
    with pytest.raises(ConfigError, match=r"loss must be a scalar .* shape \(2,\)"):
        d.check_loss(torch.tensor([1.0, NAN]), 1)
    with pytest.raises(ConfigError, match=r"shape \(0,\)"):
        d.check_loss(torch.tensor([]), 1)


def test_bad_gradients_after_good_losses_still_lead_to_rollback():
    d = NaNDetector(max_consecutive=3)
    for step in range(5):
        assert d.check_loss(1.0, step)
        assert not d.check_gradients(_model_with_grads(NAN), step)
        assert d.state.consecutive_nans == step + 1
    assert d.should_rollback and d.state.last_good_step == 0


def test_check_gradients_reads_the_device_once(monkeypatch):
    """The hot path: one host read (the final flag), whatever the number of parameters."""
    m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
    m(torch.randn(2, 4)).sum().backward()
    reads = {"n": 0}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _orig=original, **k):
            reads["n"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    assert NaNDetector().check_gradients(m, step=1)
    assert reads["n"] == 1


def test_raise_action_raises_after_recording(event_log: Path):
    d = NaNDetector(action="raise")
    with pytest.raises(RuntimeError, match="NaN/Inf loss at step 9"):
        d.check_loss(NAN, 9)
    assert d.state.total_nans == 1 and _kinds(event_log) == ["nan_detected"]


def test_history_keeps_the_most_recent():
    d = NaNDetector(max_history=3)
    for step in range(10):
        d.check_loss(NAN, step)
    assert d.state.nan_steps == [7, 8, 9] and d.state.total_nans == 10
    d0 = NaNDetector(max_history=0)
    d0.check_loss(NAN, 1)
    assert d0.state.nan_steps == []


def test_reset():
    d = NaNDetector(max_consecutive=1)
    d.check_loss(NAN, 1)
    assert d.should_rollback
    d.reset()
    assert d.state == NaNState() and not d.should_rollback


def _model_with_grads(bad: float | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    m(torch.randn(2, 4)).sum().backward()
    if bad is not None:
        m[1].weight.grad[0, 2] = bad
    return m


def test_check_gradients_finite():
    assert NaNDetector().check_gradients(_model_with_grads(), step=1)
    assert NaNDetector().check_gradients(torch.nn.Linear(2, 2), step=1)  # no grads at all


def test_check_gradients_large_but_finite_is_not_a_nan():
    m = _model_with_grads(3e38)  # an L2 norm would overflow to inf here
    assert NaNDetector().check_gradients(m, step=1)


@pytest.mark.parametrize("bad", [NAN, INF])
def test_check_gradients_names_the_parameter(bad, event_log: Path):
    m = _model_with_grads(bad)
    d = NaNDetector()
    assert d.check_gradients(m, step=4) is False
    ev = json.loads(event_log.read_text().splitlines()[0])
    assert ev["kind"] == "nan_detected" and ev["source"] == "gradients"
    assert ev["params"] == ["1.weight"]
    assert m[1].weight.grad is not None  # warn leaves gradients alone


def test_skip_drops_gradients_so_the_optimizer_step_is_a_no_op():
    m = _model_with_grads(NAN)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    d = NaNDetector(action="skip")
    assert d.check_gradients(m, step=1) is False
    assert all(p.grad is None for p in m.parameters())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))


def test_loss_and_gradients_of_one_step_count_once():
    d = NaNDetector()
    d.check_loss(1.0, 1)
    assert d.check_loss(2.0, 2)
    assert not d.check_gradients(_model_with_grads(NAN), step=2)
    # the step is bad: it is counted once and is no longer the last good step
    assert (d.state.total_nans, d.state.consecutive_nans) == (1, 1)
    assert (d.state.last_good_step, d.state.last_good_loss) == (1, 1.0)
    d.check_loss(NAN, 3)
    d.check_gradients(_model_with_grads(NAN), step=3)
    assert d.state.total_nans == 2 and d.state.nan_steps == [2, 3]


def test_state_dict_round_trip_and_bad_state():
    d = NaNDetector()
    d.check_loss(3.0, 1)
    d.check_loss(NAN, 2)
    saved = json.loads(json.dumps(d.state_dict()))  # survives JSON too
    d2 = NaNDetector()
    d2.load_state_dict(saved)
    assert d2.state == d.state
    with pytest.raises(ConfigError, match="missing keys"):
        d2.load_state_dict({"consecutive_nans": 1})
    bad = dict(saved, total_nans=-1)
    with pytest.raises(ConfigError, match=r"state\.total_nans"):
        d2.load_state_dict(bad)
    with pytest.raises(ConfigError, match="nan_steps"):
        d2.load_state_dict(dict(saved, nan_steps=["a"]))
    assert d2.state == d.state  # a failed load leaves the state as it was


@settings(max_examples=60, deadline=None)
@given(
    seq=st.lists(st.sampled_from([0.5, 2.0, NAN, INF]), max_size=40),
    max_consecutive=st.integers(1, 6),
    max_history=st.integers(0, 8),
)
def test_counts_match_a_reference_model(seq, max_consecutive, max_history):
    d = NaNDetector(max_consecutive=max_consecutive, max_history=max_history)
    run = 0
    for step, loss in enumerate(seq):
        assert d.check_loss(loss, step) == math.isfinite(loss)
        run = 0 if math.isfinite(loss) else run + 1
        assert d.state.consecutive_nans == run
        assert d.should_rollback == (run >= max_consecutive)
    bad_steps = [i for i, v in enumerate(seq) if not math.isfinite(v)]
    assert d.state.total_nans == len(bad_steps)
    assert d.state.nan_steps == (bad_steps[-max_history:] if max_history else [])
