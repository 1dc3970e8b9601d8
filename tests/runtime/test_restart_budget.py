"""The restart budget: at most N restarts inside any sliding window."""

from __future__ import annotations

from ppserve.engine.runtime.restart_budget import RestartBudget


def test_budget_refuses_past_the_limit_and_recovers_as_the_window_slides() -> None:
    budget = RestartBudget(limit=3, window_s=600.0)
    assert [budget.take(t) for t in (0.0, 10.0, 20.0)] == [True, True, True]
    assert not budget.take(30.0)  # a fourth within 10 minutes
    assert not budget.take(599.0)
    assert budget.take(600.0)  # the first restart has left the window
    assert not budget.take(601.0)


def test_zero_means_never() -> None:
    assert not RestartBudget(limit=0, window_s=600.0).take(0.0)
