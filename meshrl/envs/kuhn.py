"""Kuhn poker: a two-player zero-sum card game whose optimal play is known
exactly (Kuhn 1950), small enough to compute a best response to any strategy.

Three cards, J < Q < K. Each player antes 1 chip and is dealt one card; the
third is unseen. Player 1 acts first. A player's action is one character:
`c` checks (no bet to answer) or calls (a bet to answer, adding 1 chip), `b`
bets 1 chip (only when no bet is on the table), `f` folds. Anything else a
model writes counts as `f`. Histories:

    c c      showdown for 1        b c      showdown for 2
    c b c    showdown for 2        b f      player 1 wins 1
    c b f    player 2 wins 1       f, c f   the folder loses its ante

A player sees its own card, its seat and every action so far: its view at a
decision is `<card><seat>:<history>` (player 2 holding a queen after a bet:
`Q2:b`). The Nash equilibria give player 1 an expected -1/18 chip a game, so a
strategy's exploitability (the chips a best response wins against it,
averaged over the two seats) is 0 exactly at equilibrium.

A model plays from its own token sequence per seat (`Game`): games dealt between
model players and the fixed opponents (`deal`, `FIXED`), their results, and a
model's strategy read from its log-probs at every decision (`strategy_of`).
`meshrl.loop.games` plays them over the policy meshes.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from meshrl.envs.rollout import EpisodeState

CARDS = "JQK"
ACTIONS = "cbf"
"""Check/call, bet, fold: the legal actions of every decision."""
DECISIONS = ("", "c", "b", "cb")
"""The histories where someone acts: player 1 at "" and "cb", player 2 at "c" and "b"."""
DEALS = [(a, b) for a in CARDS for b in CARDS if a != b]
"""(player 1's card, player 2's card): the six deals, equally likely."""

Strategy = Callable[[str, str], dict[str, float]]
"""(card, history) -> probability of each action of ACTIONS."""


def seat_to_act(history: str) -> int:
    """0 (player 1) or 1 (player 2)."""
    return len(history) % 2


def is_terminal(history: str) -> bool:
    return history.endswith("f") or history in ("cc", "bc", "cbc")


def legal(history: str) -> str:
    """The actions that are not a fold by default: facing a bet, c (call) and f."""
    return "cf" if history.endswith("b") else "cbf"


def step(history: str, action: str) -> str:
    """The history after `action`; an action that is not legal folds."""
    return history + (action if action in legal(history) else "f")


def payoff(cards: tuple[str, str], history: str) -> int:
    """Chips player 1 wins (player 2 loses them) at a terminal history."""
    if history.endswith("f"):  # the folder loses what it put in: its ante (a bet never folds)
        return 1 if seat_to_act(history[:-1]) == 1 else -1
    stake = 2 if "b" in history else 1
    return stake if CARDS.index(cards[0]) > CARDS.index(cards[1]) else -stake


def view(card: str, seat: int, history: str) -> str:
    """What the player in `seat` sees: its card, its seat (1 or 2) and the history."""
    return f"{card}{seat + 1}:{history}"


def play(
    cards: tuple[str, str], players: tuple[Strategy, Strategy], rng: random.Random
) -> tuple[str, int]:
    """One game between two strategies (player 1 first): its history and player 1's chips."""
    history = ""
    while not is_terminal(history):
        seat = seat_to_act(history)
        probs = players[seat](cards[seat], history)
        history = step(history, rng.choices(ACTIONS, [probs.get(a, 0.0) for a in ACTIONS])[0])
    return history, payoff(cards, history)


# --- fixed opponents ------------------------------------------------------------------


def random_strategy(card: str, history: str) -> dict[str, float]:
    """Uniform over the sensible actions: check or bet, or call or fold a bet."""
    return {"c": 0.5, "f": 0.5} if history.endswith("b") else {"c": 0.5, "b": 0.5}


def heuristic_strategy(card: str, history: str) -> dict[str, float]:
    """By card strength: a king bets and calls, a queen checks and calls, a jack
    checks and folds to a bet."""
    facing_bet = history.endswith("b")
    if card == "K":
        return {"c": 1.0} if facing_bet else {"b": 1.0}
    if card == "Q":
        return {"c": 1.0}
    return {"f": 1.0} if facing_bet else {"c": 1.0}


def nash_strategy(alpha: float = 1 / 6) -> Strategy:
    """A Nash equilibrium of the family Kuhn found (alpha in [0, 1/3]: player 1
    bluffs a jack with probability alpha)."""
    table = {
        ("J", ""): {"b": alpha, "c": 1 - alpha},
        ("Q", ""): {"c": 1.0},
        ("K", ""): {"b": 3 * alpha, "c": 1 - 3 * alpha},
        ("J", "cb"): {"f": 1.0},
        ("Q", "cb"): {"c": alpha + 1 / 3, "f": 2 / 3 - alpha},
        ("K", "cb"): {"c": 1.0},
        ("J", "c"): {"b": 1 / 3, "c": 2 / 3},
        ("Q", "c"): {"c": 1.0},
        ("K", "c"): {"b": 1.0},
        ("J", "b"): {"f": 1.0},
        ("Q", "b"): {"c": 1 / 3, "f": 2 / 3},
        ("K", "b"): {"c": 1.0},
    }
    return lambda card, history: table[(card, history)]


# --- exact evaluation -----------------------------------------------------------------


def expected_payoff(players: tuple[Strategy, Strategy]) -> float:
    """Player 1's expected chips over the six deals and both strategies' randomness."""

    def value(cards: tuple[str, str], history: str) -> float:
        if is_terminal(history):
            return payoff(cards, history)
        seat = seat_to_act(history)
        probs = players[seat](cards[seat], history)
        return sum(p * value(cards, step(history, a)) for a, p in probs.items() if p > 0)

    return sum(value(deal, "") for deal in DEALS) / len(DEALS)


def best_response_value(strategy: Strategy, seat: int) -> float:
    """The most chips a player in `seat` can expect against `strategy` in the
    other seat: the best of its 3^6 pure strategies (each of its six decisions,
    three cards x two histories, fixed), evaluated exactly."""
    mine = [(card, h) for card in CARDS for h in DECISIONS if seat_to_act(h) == seat]
    best = float("-inf")
    for choice in itertools.product(ACTIONS, repeat=len(mine)):
        table = dict(zip(mine, choice, strict=True))
        pure: Strategy = lambda card, history, t=table: {t[(card, history)]: 1.0}  # noqa: E731
        players = (pure, strategy) if seat == 0 else (strategy, pure)
        sign = 1 if seat == 0 else -1
        best = max(best, sign * expected_payoff(players))
    return best


def exploitability(strategy: Strategy) -> float:
    """Chips a best response wins per game against `strategy`, averaged over the
    two seats: 0 at a Nash equilibrium, more the more exploitable."""
    return (best_response_value(strategy, 0) + best_response_value(strategy, 1)) / 2


# --- model players --------------------------------------------------------------------
#
# Each seat a model plays is its own token sequence: its view at its first turn, then
# its own sampled tokens and the opponent's actions since its last turn
# (`meshrl.loop.games.Match` writes them, playing over the policy meshes).

FIXED: dict[str, Strategy] = {"random": random_strategy, "heuristic": heuristic_strategy}
"""The fixed opponents, by name."""


@dataclass
class Game:
    cards: tuple[str, str]
    players: tuple[str, str]
    """Who sits in seat 1 (acts first) and seat 2: a model player's name or a FIXED one."""
    history: str = ""
    sequences: dict[int, EpisodeState] = field(default_factory=dict)
    """Per seat a model plays: its token sequence."""
    seen: dict[int, int] = field(default_factory=dict)
    """Per seat: how much of the history its sequence holds."""

    @property
    def done(self) -> bool:
        return is_terminal(self.history)

    def chips(self, seat: int) -> int:
        """What the player in `seat` won (negative: lost) in the finished game."""
        won = payoff(self.cards, self.history)
        return won if seat == 0 else -won


def deal(count: int, pairings: list[tuple[str, str]], rng: random.Random) -> list[Game]:
    """`count` games, cards drawn with `rng`, the pairings taking turns (so a
    player sits in both seats equally often when each pairing has its mirror)."""
    return [Game(rng.choice(DEALS), pairings[i % len(pairings)]) for i in range(count)]


def results(games: list[Game], name: str) -> dict[str, float]:
    """`name`'s share of games won and mean chips a game."""
    chips = [g.chips(seat) for g in games for seat in (0, 1) if g.players[seat] == name]
    return {
        "win_rate": sum(c > 0 for c in chips) / len(chips),
        "chips": sum(chips) / len(chips),
    }


def decisions(tokenizer: Any) -> list[tuple[str, str, list[int]]]:
    """(card, history, token ids) of each of the 12 decisions, the ids as the
    deciding player's sequence holds them: its view at its first turn, then its
    own earlier action and the opponent's."""
    found = []
    for card in CARDS:
        for history in DECISIONS:
            seat = seat_to_act(history)
            first = "" if seat == 0 else history  # the history at its first turn
            ids = tokenizer(view(card, seat, first)).input_ids
            ids += tokenizer(history[len(first) :], add_special_tokens=False).input_ids
            found.append((card, history, ids))
    return found


def random_actions(history: str) -> str:
    """The actions random play takes at `history` (check or bet; call or fold a bet)."""
    return "".join(a for a, p in random_strategy("", history).items() if p > 0)


def strategy_of(logprobs: torch.Tensor, keys: list[tuple[str, str, str]]) -> Strategy:
    """A model's strategy from the log-probs of `meshrl.loop.games.strategy_batch`:
    its probability of writing c and b at each decision, everything else a fold
    (as in play; a b facing a bet folds too)."""
    table: dict[tuple[str, str], dict[str, float]] = {}
    for (card, history, action), logprob in zip(keys, logprobs[:, 0].tolist(), strict=True):
        probs = table.setdefault((card, history), {"f": 1.0})
        if action in legal(history):
            probs[action] = float(torch.tensor(logprob).exp())
            probs["f"] -= probs[action]
    for probs in table.values():
        probs["f"] = max(probs["f"], 0.0)
    return lambda card, history: table[(card, history)]
