"""Kuhn poker's rules and exact evaluation, against figures known in closed form."""

import random

import pytest

from meshrl.envs import kuhn
from meshrl.loop.games import strategy_batch
from meshrl.model.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.unit


def test_payoffs_and_illegal_actions():
    assert kuhn.payoff(("K", "J"), "cc") == 1 and kuhn.payoff(("J", "K"), "cc") == -1
    assert kuhn.payoff(("K", "Q"), "bc") == 2 and kuhn.payoff(("Q", "K"), "cbc") == -2
    assert kuhn.payoff(("J", "K"), "bf") == 1  # player 2 folds to a bet: it loses its ante
    assert kuhn.payoff(("K", "J"), "cbf") == -1 and kuhn.payoff(("K", "J"), "f") == -1
    assert kuhn.step("b", "b") == "bf"  # no raise: an illegal action folds
    assert kuhn.step("", "x") == "f" and kuhn.step("c", "b") == "cb"
    assert [h for h in ("cc", "bc", "cbc", "bf", "cbf", "f", "cf") if not kuhn.is_terminal(h)] == []


def test_equilibrium_value_and_exploitability():
    for alpha in (0.0, 0.1, 1 / 3):  # Kuhn's family of equilibria: value -1/18 for player 1
        nash = kuhn.nash_strategy(alpha)
        assert kuhn.expected_payoff((nash, nash)) == pytest.approx(-1 / 18)
        assert kuhn.exploitability(nash) == pytest.approx(0.0, abs=1e-12)
    assert kuhn.exploitability(lambda card, history: {"f": 1.0}) == pytest.approx(1.0)
    assert kuhn.exploitability(kuhn.random_strategy) == pytest.approx(11 / 24)
    assert kuhn.exploitability(kuhn.heuristic_strategy) == pytest.approx(1 / 6)


def test_a_model_strategy_is_read_at_the_contexts_it_plays_in():
    tokenizer = build_char_tokenizer()
    batch, keys = strategy_batch(tokenizer)
    assert len(keys) == 3 * 4 * 2  # 3 cards x 4 decisions x {c, b}
    rows = {
        key: tokenizer.decode(batch.input_ids[i], skip_special_tokens=True)
        for i, key in enumerate(keys)
    }
    assert rows[("K", "", "b")] == "K1:b"  # its view, then the action scored
    assert rows[("Q", "cb", "c")] == "Q1:cbc"  # player 1's view at its first turn + c, b
    assert rows[("J", "b", "c")] == "J2:bc"
    # c with probability 0.25 and b 0.5: folds 0.25; facing a bet b folds too.
    logprobs = batch.old_logprobs.clone()
    for i, (_, _, action) in enumerate(keys):
        logprobs[i, 0] = -1.3862943611198906 if action == "c" else -0.6931471805599453
    strategy = kuhn.strategy_of(logprobs, keys)
    assert strategy("K", "") == pytest.approx({"c": 0.25, "b": 0.5, "f": 0.25})
    assert strategy("K", "b") == pytest.approx({"c": 0.25, "f": 0.75})


def test_deals_alternate_seats_and_results_count_each_seat():
    games = kuhn.deal(4, [("a", "random"), ("random", "a")], random.Random(0))
    assert [g.players for g in games] == [("a", "random"), ("random", "a")] * 2
    won = kuhn.Game(("K", "J"), ("a", "b"), "cc")
    lost = kuhn.Game(("K", "J"), ("b", "a"), "bc")
    assert kuhn.results([won, lost], "a") == {"win_rate": 0.5, "chips": (1 - 2) / 2}
