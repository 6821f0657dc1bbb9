"""Co-evolution on real meshes: two players' own weights and versions, each
player's loss mask on its own tokens only, exact resume of both, a lost trainer
that takes back only its own player, and self-play."""

import os
import random

import pytest
import torch

from algorithms.coevolve import Coevolve, CoevolveConfig
from meshrl.config import load_config
from meshrl.envs import kuhn
from meshrl.envs.kuhn import deal
from tests.support.coevolve import CONFIG
from tests.support.runs import QUIET, undocumented_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def config(tmp_path, name, *overrides):
    return load_config(
        CoevolveConfig,
        CONFIG,
        [
            "steps=8",
            "games_per_step=16",
            "eval.every=100",
            "eval_games=20",
            "checkpoint.every=4",
            "warm_start.steps=10",  # the format first, so that the first steps train
            f"run.dir={tmp_path}",
            f"run.name={name}",
            *QUIET,
            *overrides,
        ],
    )


def weights(algo):
    """Each player's trainer parameters now."""
    return {
        name: next(w for w in algo.sup.call_all(player.trainer, "parameters") if w)
        for name, player in algo.players.items()
    }


def same(x, y):
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def check_masks(algo):
    """In every sequence a player trains on, the loss covers exactly its own
    actions; the opponent's actions are there, masked."""
    games = deal(8, [("a", "b"), ("b", "a")], random.Random(1))
    algo.match.play(games, random.Random(2))
    tokenizer = algo.tokenizer
    for name in ("a", "b"):
        completions, _, seats = algo.match.sequences(games, name)
        histories = [g.history for g in games for s in sorted(g.sequences) if g.players[s] == name]
        for row, (seat, history) in enumerate(zip(seats.tolist(), histories, strict=True)):
            ids = completions.completion_ids[row]
            mask, attention = completions.completion_mask[row], completions.attention[row]
            own = [i for i in range(len(ids)) if mask[i] == 1]
            other = [i for i in range(len(ids)) if attention[i] == 1 and mask[i] == 0]
            acted = [i for i in range(len(history)) if kuhn.seat_to_act(history[:i]) == seat]
            assert len(own) == len(acted), (history, seat)  # one token per own turn, all trained
            # Between its first and last turn, the opponent's actions, masked, as played.
            theirs = [history[i] for i in range(acted[0], acted[-1]) if i not in acted]
            assert tokenizer.decode(ids[other].tolist()) == "".join(theirs)
            assert all(o > t for o, t in zip(own[1:], other, strict=False))


def test_two_players_train_apart_resume_exactly_and_recover_alone(tmp_path, no_stray_procs):
    algo = Coevolve(config(tmp_path, "run"))
    try:
        algo.train(0)  # the meshes up, both players at version 0, evaluated once
        start = weights(algo)
        history = algo.train(7)
        seven = weights(algo)
        history = algo.train(1)
        eight = weights(algo)
        check_masks(algo)  # (after: its games draw from the replicas' sampling streams)
    finally:
        algo.stop()
    records = algo.log.history
    assert [r["step"] for r in records] == list(range(8))
    assert not undocumented_metrics(records, "algorithms/coevolve.md")
    assert not same(start["a"], start["b"])  # two models, from two seeds
    assert not same(start["a"], seven["a"]) and not same(start["b"], seven["b"])
    assert [r["a/weights/version"] for r in records] == list(range(11, 19))  # after 10 warm-start
    assert "eval/a/exploitability" in records[-1] and "eval/b/win_rate_vs_random" in records[-1]
    assert history[-1]["step"] == 7

    # Exact resume: from the step-4 checkpoint, both players end where the run did.
    resume = os.path.join(tmp_path, "run", "checkpoints", "step_00000004")
    again = Coevolve(config(tmp_path, "resumed", f"checkpoint.resume={resume}"))
    try:
        again.train(4)
        assert same(weights(again)["a"], eight["a"]) and same(weights(again)["b"], eight["b"])
    finally:
        again.close()

    # A's trainer dies at the start of step 6: A goes back to its step-4 checkpoint;
    # B keeps all seven of its steps, exactly those of the run without the fault.
    faulty = Coevolve(config(tmp_path, "faulty", "faults.kill=[trainer_a:0@6]"))
    try:
        records = faulty.train(7)
        after = weights(faulty)
        faulty.set_lr(5e-4)  # a notebook call: both players' trainers take it
    finally:
        faulty.close()
    assert records[6]["a/recovered_from_step"] == 4 and "a/weights/version" not in records[6]
    assert [r["b/weights/version"] for r in records] == list(range(11, 18))
    assert same(after["b"], seven["b"])
    assert not same(after["a"], seven["a"])


def test_self_play_runs_one_policy_in_both_seats(tmp_path, no_stray_procs):
    algo = Coevolve(config(tmp_path, "self", "shared_policy=true", "steps=2", "checkpoint.every=0"))
    try:
        records = algo.train(2)
        games = deal(16, [("a", "a")], random.Random(0))
        algo.match.play(games, random.Random(0))
        completions, _, seats = algo.match.sequences(games, "a")
    finally:
        algo.stop()
    assert list(algo.players) == ["a"] and len(records) == 2
    assert not any(key.startswith(("b/", "eval/b/")) for r in records for key in r)
    # One policy, both seats: a row for every seat that acted, player 2's included.
    acted = sum(len(g.history) > 0 for g in games) + sum(len(g.history) > 1 for g in games)
    assert len(completions) == acted > len(games) and set(seats.tolist()) == {0, 1}
