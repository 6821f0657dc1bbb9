"""Two-player games played between policy meshes and fixed strategies, token in,
token out: the game itself and what each seat sees are `meshrl.envs.kuhn`'s (Kuhn
poker's rules, `Game`, `deal`, the fixed opponents); here are the loop's parts.

Each seat a model plays is its own token sequence: the player's view when it
first acts (its card, its seat and the actions so far), then its own sampled
tokens (loss mask 1, with their sampling log-probs) and the opponent's actions
since its last turn (loss mask 0). A player never sees the other's card, and
its loss never covers the other's tokens. Every model player acts once per
round, all of its pending games in one `generate` call over its replicas, and
the players' calls run at the same time (`Match`); the trainer's batches of
every decision (`strategy_batch`, `format_batch`).

    match = Match(sup, {"a": policy_a, "b": policy_b}, tokenizer, generation)
    games = kuhn.deal(64, [("a", "b"), ("b", "a")], rng)
    match.play(games, rng)
    completions, rewards, seats = match.sequences(games, "a")   # A's rows, rewards in [-1, 1]
"""

from __future__ import annotations

import random
from typing import Any

import torch

from meshrl.envs import kuhn
from meshrl.envs.rollout import EpisodeState, to_completions
from meshrl.loop.supervised import supervised_batch
from meshrl.procs.mesh import split, start_each
from meshrl.types import Completions, Prompt, TrainBatch


class Match:
    """Plays games between the model players (`models`: name -> policy `Role`) and
    the fixed strategies (`kuhn.FIXED`). `sup` (a `Supervisor`) makes the generate
    calls, so a lost replica is replaced and its call made again."""

    def __init__(self, sup: Any, models: dict[str, Any], tokenizer: Any, generation: Any):
        self.sup, self.models, self.tokenizer, self.generation = sup, models, tokenizer, generation

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _context(self, game: kuhn.Game, seat: int) -> list[int]:
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

    def play(self, games: list[kuhn.Game], rng: random.Random) -> None:
        """Play every game to its end; fixed strategies draw with `rng`."""
        while True:
            pending: dict[str, list[tuple[kuhn.Game, int]]] = {name: [] for name in self.models}
            for game in games:
                while not game.done:
                    seat = kuhn.seat_to_act(game.history)
                    name = game.players[seat]
                    if name in self.models:
                        pending[name].append((game, seat))
                        break
                    probs = kuhn.FIXED[name](game.cards[seat], game.history)
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

    def _act(self, turns: list[tuple[kuhn.Game, int]], parts: list[Completions]) -> None:
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
        self, games: list[kuhn.Game], name: str
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


def strategy_batch(tokenizer: Any) -> tuple[TrainBatch, list[tuple[str, str, str]]]:
    """Every decision's context with c and with b as a one-token completion: a
    batch whose log-probs give a model's strategy (`kuhn.strategy_of`); and the
    (card, history, action) of each row."""
    prompts, targets, keys = [], [], []
    for card, history, ids in kuhn.decisions(tokenizer):
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
    for _, history, ids in kuhn.decisions(tokenizer):
        for action in kuhn.random_actions(history):
            prompts.append(ids)
            targets.append(tokenizer(action, add_special_tokens=False).input_ids)
    return supervised_batch(prompts, targets, tokenizer.pad_token_id)
