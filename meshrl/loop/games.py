"""Two-player games between policy meshes and fixed strategies (Kuhn poker,
`meshrl.envs.kuhn`), token in, token out.

Each seat a model plays is its own token sequence: the player's view when it
first acts (its card, its seat and the actions so far), then its own sampled
tokens (loss mask 1, with their sampling log-probs) and the opponent's actions
since its last turn (loss mask 0). A player never sees the other's card, and
its loss never covers the other's tokens. Every model player acts once per
round, all of its pending games in one `generate` call over its replicas, and
the players' calls run at the same time.

    match = Match(sup, {"a": policy_a, "b": policy_b}, tokenizer, generation)
    games = deal(64, [("a", "b"), ("b", "a")], rng)
    match.play(games, rng)
    completions, rewards, seats = match.sequences(games, "a")   # A's rows, rewards in [-1, 1]
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.envs import kuhn
from meshrl.envs.rollout import EpisodeState, to_completions
from meshrl.loop.supervised import supervised_batch
from meshrl.procs.mesh import split, start_each
from meshrl.types import Completions, Prompt, TrainBatch

FIXED = {"random": kuhn.random_strategy, "heuristic": kuhn.heuristic_strategy}
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
        return kuhn.is_terminal(self.history)

    def chips(self, seat: int) -> int:
        """What the player in `seat` won (negative: lost) in the finished game."""
        won = kuhn.payoff(self.cards, self.history)
        return won if seat == 0 else -won


def deal(count: int, pairings: list[tuple[str, str]], rng: random.Random) -> list[Game]:
    """`count` games, cards drawn with `rng`, the pairings taking turns (so a
    player sits in both seats equally often when each pairing has its mirror)."""
    return [Game(rng.choice(kuhn.DEALS), pairings[i % len(pairings)]) for i in range(count)]


class Match:
    """Plays games between the model players (`models`: name -> policy `Role`) and
    the FIXED strategies. `sup` (a `Supervisor`) makes the generate calls, so a
    lost replica is replaced and its call made again."""

    def __init__(self, sup: Any, models: dict[str, Any], tokenizer: Any, generation: Any):
        self.sup, self.models, self.tokenizer, self.generation = sup, models, tokenizer, generation

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _context(self, game: Game, seat: int) -> list[int]:
        """The seat's sequence brought up to date: its view the first time, else
        the opponent's actions since its last turn (masked)."""
        if seat not in game.sequences:
            text = kuhn.view(game.cards[seat], seat, game.history)
            ids = self.tokenizer(text).input_ids
            game.sequences[seat] = EpisodeState("", Prompt(text, ""), ids)
        else:
            new = self._tokens(game.history[game.seen[seat] :])
            sequence = game.sequences[seat]
            sequence.tokens += new
            sequence.loss_mask += [0] * len(new)
            sequence.logprobs += [0.0] * len(new)
            sequence.versions += [-1] * len(new)
        game.seen[seat] = len(game.history)
        return game.sequences[seat].context()

    def play(self, games: list[Game], rng: random.Random) -> None:
        """Play every game to its end; fixed strategies draw with `rng`."""
        while True:
            pending: dict[str, list[tuple[Game, int]]] = {name: [] for name in self.models}
            for game in games:
                while not game.done:
                    seat = kuhn.seat_to_act(game.history)
                    name = game.players[seat]
                    if name in self.models:
                        pending[name].append((game, seat))
                        break
                    probs = FIXED[name](game.cards[seat], game.history)
                    action = rng.choices(kuhn.ACTIONS, [probs.get(a, 0.0) for a in kuhn.ACTIONS])
                    game.history = kuhn.step(game.history, action[0])
            pending = {name: turns for name, turns in pending.items() if turns}
            if not pending:
                return
            started = {}
            for name, turns in pending.items():  # every player's replicas at once
                shards = split([self._context(g, s) for g, s in turns], self.models[name].size)
                args = [(shard, self.generation) for shard in shards]
                role = self.models[name]
                started[name] = (args, start_each(role, "generate", args), role.respawns)
            for name, (args, futures, respawns) in started.items():
                parts, _ = self.sup.call(self.models[name], "generate", args, (futures, respawns))
                self._act(pending[name], parts)

    def _act(self, turns: list[tuple[Game, int]], parts: list[Completions]) -> None:
        rows = [(p, i) for p in parts for i in range(len(p))]
        for (game, seat), (part, i) in zip(turns, rows, strict=True):
            n = int(part.completion_mask[i].sum())
            ids = part.completion_ids[i, :n].tolist()
            sequence = game.sequences[seat]
            sequence.tokens += ids
            sequence.loss_mask += [1] * n
            sequence.logprobs += part.logprobs[i, :n].tolist()
            sequence.versions += [part.weight_version] * n
            text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
            game.history = kuhn.step(game.history, text[:1] if len(text) == 1 else "f")
            game.seen[seat] = len(game.history)

    def sequences(
        self, games: list[Game], name: str
    ) -> tuple[Completions, torch.Tensor, torch.Tensor]:
        """`name`'s token sequences of the finished games (one row per seat it
        played), their rewards (the chips it won, / 2, in [-1, 1]) and the seat
        (0 or 1) of each row."""
        rows, seats = [], []
        for game in games:
            for seat, sequence in sorted(game.sequences.items()):
                if game.players[seat] == name:
                    sequence.reward = game.chips(seat) / 2
                    rows.append(sequence)
                    seats.append(seat)
        completions, rewards = to_completions(rows, self.tokenizer.pad_token_id)
        return completions, rewards, torch.tensor(seats)


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
    for card in kuhn.CARDS:
        for history in kuhn.DECISIONS:
            seat = kuhn.seat_to_act(history)
            first = "" if seat == 0 else history  # the history at its first turn
            ids = tokenizer(kuhn.view(card, seat, first)).input_ids
            ids += tokenizer(history[len(first) :], add_special_tokens=False).input_ids
            found.append((card, history, ids))
    return found


def strategy_batch(tokenizer: Any) -> tuple[TrainBatch, list[tuple[str, str, str]]]:
    """Every decision's context with c and with b as a one-token completion: a
    batch whose log-probs give a model's strategy (`strategy_of`); and the
    (card, history, action) of each row."""
    prompts, targets, keys = [], [], []
    for card, history, ids in decisions(tokenizer):
        for action in "cb":
            prompts.append(ids)
            targets.append(tokenizer(action, add_special_tokens=False).input_ids)
            keys.append((card, history, action))
    return supervised_batch(prompts, targets, tokenizer.pad_token_id), keys


def format_batch(tokenizer: Any) -> TrainBatch:
    """Every decision with each sensible action as the target (check or bet; call
    or fold a bet): supervised steps on it teach the format and uniform random
    play, no strategy."""
    prompts, targets = [], []
    for _, history, ids in decisions(tokenizer):
        for action in random_actions(history):
            prompts.append(ids)
            targets.append(tokenizer(action, add_special_tokens=False).input_ids)
    return supervised_batch(prompts, targets, tokenizer.pad_token_id)


def random_actions(history: str) -> str:
    return "".join(a for a, p in kuhn.random_strategy("", history).items() if p > 0)


def strategy_of(logprobs: torch.Tensor, keys: list[tuple[str, str, str]]) -> kuhn.Strategy:
    """A model's strategy from `strategy_batch`'s log-probs: its probability of
    writing c and b at each decision, everything else a fold (as in play; a b
    facing a bet folds too)."""
    table: dict[tuple[str, str], dict[str, float]] = {}
    for (card, history, action), logprob in zip(keys, logprobs[:, 0].tolist(), strict=True):
        probs = table.setdefault((card, history), {"f": 1.0})
        if action in kuhn.legal(history):
            probs[action] = float(torch.tensor(logprob).exp())
            probs["f"] -= probs[action]
    for probs in table.values():
        probs["f"] = max(probs["f"], 0.0)
    return lambda card, history: table[(card, history)]
