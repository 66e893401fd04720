"""A rank's life as one state (issue 68, steadfast.monitor.ranks): the transitions drawn
in the module's docstring, and only those; the row's end marks read into it."""

from __future__ import annotations

import logging

import pytest

from steadfast.monitor.ranks import Ranks, RankState
from steadfast.progress.layout import COLLECTIVES_DONE, ENDED, FINISHED

S = RankState


def _ranks(n: int = 2) -> tuple[Ranks, list[list[float]]]:
    slots = [[0.0] * 256 for _ in range(n)]
    ranks = Ranks(dict(enumerate(slots)))
    ranks.new_generation({local: 100 + local for local in range(n)})
    return ranks, slots


def test_a_rank_starts_runs_and_ends():
    ranks, _ = _ranks()
    assert ranks.get(0).state == S.STARTING  # type: ignore[union-attr]
    assert ranks.observe(0, 100, alive=True).state == S.RUNNING  # type: ignore[union-attr]
    assert ranks.to(0, 100, S.HUNG, hang=("heartbeat", 1.0)).hang == ("heartbeat", 1.0)  # type: ignore[union-attr]
    assert ranks.to(0, 100, S.ENDED).state == S.ENDED  # type: ignore[union-attr]
    assert ranks.get(0).hang == ("heartbeat", 1.0)  # type: ignore[union-attr]  # the claim stays


@pytest.mark.parametrize(
    ("mark", "state"),
    [(COLLECTIVES_DONE, S.FINISHED), (FINISHED, S.FINISHED), (ENDED, S.FAILED)],
)
def test_the_rows_marks_move_a_running_rank(mark: int, state: RankState):
    ranks, slots = _ranks()
    ranks.observe(0, 100, alive=True)
    slots[0][mark] = 5.0
    assert ranks.observe(0, 100, alive=True).state == state  # type: ignore[union-attr]
    assert (ranks.over(0) is not None) == (state == S.FINISHED)


def test_a_transition_not_drawn_is_refused_and_logged(caplog: pytest.LogCaptureFixture):
    ranks, _ = _ranks()
    ranks.to(0, 100, S.HUNG)
    with caplog.at_level(logging.ERROR):
        assert ranks.to(0, 100, S.FINISHED) is None  # a hung rank is a fault: not finished
    assert "hung -> finished is no transition" in caplog.text
    assert ranks.get(0).state == S.HUNG  # type: ignore[union-attr]
    ranks.to(1, 101, S.FAILED)
    assert ranks.to(1, 101, S.TEARING_DOWN) is None  # a failed script is no teardown


def test_a_rank_of_a_replaced_generation_is_left_alone():
    ranks, _ = _ranks()
    assert ranks.to(0, 999, S.RUNNING) is None
    assert ranks.get(0).state == S.STARTING  # type: ignore[union-attr]


def test_the_others_have_finished_once_each_marked_its_training_over():
    ranks, slots = _ranks(3)
    assert not ranks.others_finished(2)
    slots[0][COLLECTIVES_DONE] = 1.0
    assert not ranks.others_finished(2)
    slots[1][FINISHED] = 2.0
    assert ranks.others_finished(2)
    assert not ranks.others_finished(0)  # rank 2 has not
    alone, _ = _ranks(1)
    assert not alone.others_finished(0)  # no other rank: nothing finished before it
