"""Co-evolution: two policies, each with its own meshes, train against each other.

Players A and B each have a policy mesh, a trainer mesh (its own optimizer,
weights and weight version), a `WeightSync` and a part of every checkpoint
(`a/`, `b/`). Their metrics are prefixed `a/` and `b/`. Each step deals
`games_per_step` games of Kuhn poker (`meshrl.envs.kuhn`), A in the first seat
of half of them and B in the other half. Both policies' replicas play all the
games at once, token in, token out (`meshrl.loop.games.Match`): each player's
sequences hold its own sampled tokens (trained) and the opponent's actions
(masked). The game is zero-sum. Each player's reward is the chips it won, / 2;
its advantage is that reward minus the mean of its rewards in the same seat
this step, over their std. Both trainers then take one clipped
policy-gradient step at once, and each player's replicas pull their own new
weights.

Every `eval.every` steps each player plays `eval_games` held-out games against
each fixed opponent (uniform random, a card-strength heuristic), in both
seats. Its exact exploitability is also computed, from its trainer's
probability of each action at each of Kuhn poker's 12 decisions.

`shared_policy: true` is self-play: the same script with one policy (A) in
both seats.

Faults: a lost trainer proc of one player restores that player alone from the
newest checkpoint (`faults.kill: [trainer_a:0@5]` drills it). The other player
keeps every step it took.

    python -m algorithms.coevolve --config algorithms/configs/coevolve.yaml
    python -m algorithms.coevolve --config algorithms/configs/coevolve.yaml shared_policy=true
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from algorithms.base import Algorithm, Loss, run_main
from algorithms.rl_config import HeldOutConfig, check_sections
from algorithms.roles import heal_trainer, spawn_policy, spawn_trainer
from meshrl.config import (
    ConfigError,
    GenerationConfig,
    HealthConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    PolicyConfig,
    RunConfig,
    WarmStartConfig,
)
from meshrl.config.trainer import TrainerConfig
from meshrl.envs import kuhn
from meshrl.envs.kuhn import FIXED, deal, results, strategy_of
from meshrl.loop.checkpoint import CheckpointConfig, Checkpointer
from meshrl.loop.games import Match, format_batch, strategy_batch
from meshrl.loop.run import Role, Run
from meshrl.loop.steplog import StepLog, add_evaluation
from meshrl.loop.supervised import supervised_steps
from meshrl.loop.supervisor import RoleLost, Supervisor
from meshrl.loop.weight_sync import WeightsConfig, WeightSync
from meshrl.model.losses import policy_loss
from meshrl.procs.faults import FaultsConfig
from meshrl.procs.job import JobConfig
from meshrl.types import TrainBatch

GAMES = ("kuhn_poker",)


@dataclass
class CoevolveConfig:
    MOVED: ClassVar[dict[str, str]] = {"eval_every": "eval.every"}
    steps: int = 200
    """Steps: one batch of games and one optimizer step per player each."""
    game: str = "kuhn_poker"
    """The two-player game: kuhn_poker (meshrl/envs/kuhn.py)."""
    games_per_step: int = 64
    """Games a step; each player sits first in half of them."""
    shared_policy: bool = False
    """Self-play: one policy (A) in both seats, one trainer."""
    clip: float = 0.2
    """PPO clip range of the policy-gradient step."""
    eval: HeldOutConfig = field(default_factory=lambda: HeldOutConfig(every=20))
    """`eval.every`: steps between evaluations against the fixed opponents (and after
    the last)."""
    eval_games: int = 300
    """Held-out games per player and fixed opponent (half in each seat)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised steps teaching the format first: every decision's sensible
    actions, uniformly (random play, no strategy); steps 0 skips it."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Both players' architecture; B's weights start from another seed (run.seed + 1)."""
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=1))
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """`policy` and `trainer` procs per player."""
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    job: JobConfig = field(default_factory=JobConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    @property
    def total_updates(self) -> int:
        """Optimizer steps of each player's trainer over the run (its LR schedule)."""
        return self.steps

    def validate(self) -> None:
        check_sections(self)
        if self.placement.policy_tp > 1:
            raise ConfigError(
                "config key 'placement.policy_tp': co-evolution's players sample with "
                "replicas of 1 proc each"
            )
        if self.game not in GAMES:
            raise ConfigError(f"config key 'game': '{self.game}' is not one of {', '.join(GAMES)}")
        for key in ("steps", "games_per_step", "eval_games"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}': must be >= 1")
        if self.games_per_step % 2 or self.eval_games % 2:
            raise ConfigError(
                "config keys 'games_per_step', 'eval_games': must be even (both seats equally)"
            )
        rows = self.games_per_step * (2 if self.shared_policy else 1)
        trainers = self.placement.trainer * self.job.hosts_for("trainer")
        if rows % trainers:
            raise ConfigError(
                f"config key 'placement.trainer': a player's {rows} sequences a step do not "
                f"split evenly over {trainers} procs"
            )
        if self.placement.colocate:
            raise ConfigError("config key 'placement.colocate': co-evolution runs its own meshes")


@dataclass
class Player:
    """One player's meshes and weight sync."""

    name: str
    policy: Role
    trainer: Role
    sync: WeightSync


class CoevolveLoss(Loss):
    """Runs on every trainer proc: the clipped surrogate, a token mean."""

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        return policy_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.completion_mask,
            clip_low=self.cfg.clip,
            scale=batch.scale,
        )


class Coevolve(Algorithm):
    name = "coevolve"
    headline = "a/reward/mean"
    Loss = CoevolveLoss
    samples = True

    def run(self, num_steps: int | None = None) -> list[dict]:
        """Spawn both players' meshes (first call), train `num_steps` more steps
        (None: to `cfg.steps`, then save both models and stop every proc)."""
        cfg, state = self.cfg, self.state
        with self.running(num_steps):  # an error: `failed`; a whole run: `stop()` at its end
            if self.runtime is None:
                self.spawn()
            log = self.log
            pairings = [("a", "a")] if cfg.shared_policy else [("a", "b"), ("b", "a")]
            # Ctrl-C or SIGTERM: stop after the step under way; the drills and pool sizes
            # due before each step; its count and the checkpoints due after it (`Steps`).
            with self.steps(num_steps) as steps:
                for step in steps:
                    with log.timer("step"):
                        # Both players' replicas play every game, a round at a time.
                        games = deal(cfg.games_per_step, pairings, state.rng)
                        with log.timer("play"):
                            self.match.play(games, state.rng)
                        batches, record = {}, {"step": step}
                        for name in self.players:
                            completions, rewards, seats = self.match.sequences(games, name)
                            batches[name] = batch = TrainBatch.from_completions(completions)
                            batch.advantages = self.advantages(rewards, seats)
                            record.update(self.rollout_metrics(name, rewards, games, batch))
                        # Both trainers step at once, each on its own player's sequences;
                        # each player's replicas then pull that player's new weights.
                        with log.timer("train"):
                            record.update(self.train_players(batches))
                    with log.timer("eval"):
                        add_evaluation(
                            record, step, cfg.eval.every, cfg.steps, self.before, self.evaluate
                        )
                    self.record_step(step, record)
        return self.log.history

    # --- the meshes ---------------------------------------------------------------------

    def spawn(self) -> None:
        """Per player a policy and a trainer mesh; their syncs, the supervisor,
        the checkpointer; version 0 on every replica (or a checkpoint's state)."""

        cfg = self.cfg
        names = ["a"] if cfg.shared_policy else ["a", "b"]
        procs = {}
        for name in names:
            procs[f"policy_{name}"] = cfg.placement.policy
            procs[f"trainer_{name}"] = cfg.placement.trainer
        # The players' policies generate at once, and their trainers train at once.
        busy = [tuple(f"{role}_{n}" for n in names) for role in ("policy", "trainer")]
        trains = tuple(f"trainer_{n}" for n in names)  # each player's: sized as a trainer
        # The actors' own figures (time/policy/generate_s, ...) per player: a/..., b/...
        prefix = {role: f"{role.rsplit('_', 1)[1]}/" for role in procs}
        run = self.runtime = Run(
            cfg, self.name, procs, busy_together=busy, trains=trains, metric_prefix=prefix
        )
        self.sup = sup = Supervisor(run, cfg.faults, self.state)
        self.players: dict[str, Player] = {}
        loss = self.make_loss()
        for i, name in enumerate(names):
            seed = cfg.run.seed + i  # B's weights start elsewhere than A's
            slots = f"{run.shm_prefix}-{name}"  # its trainer's weights, its replicas' reads
            temperature = cfg.generation.temperature
            trainer = spawn_trainer(
                run, cfg, loss, temperature, f"trainer_{name}", seed=seed, shm_prefix=slots
            )
            policy = spawn_policy(
                run, cfg, self.context, f"policy_{name}", seed, slots, lengths=cfg.faults.lengths()
            )
            sync = WeightSync.from_config(sup, cfg.weights)
            self.players[name] = player = Player(name, policy, trainer, sync)
            sup.on_respawn(f"policy_{name}", lambda p=player: p.sync.catch_up(p.policy))
            heal_trainer(sup, cfg, trainer, sync)
        roles = [r for p in self.players.values() for r in (p.trainer, p.policy)]
        subdirs = {r.name: r.name.rsplit("_", 1)[1] for r in roles}  # a/, b/
        self.ckpt = Checkpointer(
            run,
            self.state,
            roles,
            cfg.checkpoint,
            after_restore=self.sync_all,
            same_size=tuple(f"policy_{n}" for n in names),
            subdirs=subdirs,
        )
        fresh = self.ckpt.resume() is None
        if fresh:
            if cfg.warm_start.steps:  # the format only: uniform over the sensible actions
                for name, player in self.players.items():
                    supervised_steps(
                        sup,
                        player.trainer,
                        lambda step: format_batch(self.tokenizer),
                        cfg.warm_start.steps,
                        cfg.warm_start.lr,
                        f"{run.dir}/warm_start_{name}.jsonl",
                        f"warm-start {name}",
                    )
            self.sync_all()  # each trainer's weights on its player's replicas
        policies = {name: player.policy for name, player in self.players.items()}
        self.match = Match(sup, policies, self.tokenizer, cfg.generation)
        self.log = StepLog(run, cfg.steps, self.state.step, self.headline)
        self.before = self.evaluate() if fresh else {}

    def trainers(self) -> list:
        return [player.trainer for player in self.players.values()]

    def sync_all(self) -> None:
        for player in self.players.values():
            player.sync.pull(player.policy, player.sync.publish(player.trainer))

    def train_players(self, batches: dict[str, TrainBatch]) -> dict[str, float]:
        """One optimizer step of every player's trainer, all at once, then each
        player's weight sync. A player whose trainer proc was lost is restored
        from the newest checkpoint (`recover`); the others keep their step."""
        trainers = {self.players[name].trainer: batch for name, batch in batches.items()}
        answers = self.sup.call_apart(trainers, "train_step")
        metrics: dict[str, float] = {}
        for name in batches:
            player = self.players[name]
            answer = answers[player.trainer.name]
            if isinstance(answer, RoleLost):  # no peer to heal from: this player alone
                metrics[f"{name}/recovered_from_step"] = self.recover(player, answer)
                continue
            metrics.update({f"{name}/{k}": v for k, v in answer.items()})
            player.sync.pull(player.policy, player.sync.publish(player.trainer))
            metrics[f"{name}/weights/version"] = player.sync.version
        return metrics

    def recover(self, player: Player, lost: RoleLost) -> int:
        """`player`'s trainer from the newest checkpoint, on new procs, the other
        player as it is; its replicas pull the restored weights. Returns the
        checkpoint's step."""
        step = self.ckpt.rewind_roles(lost, self.sup, [player.trainer])
        player.sync.pull(player.policy, player.sync.publish(player.trainer))
        return step

    # --- the math -----------------------------------------------------------------------

    def advantages(self, rewards: torch.Tensor, seats: torch.Tensor) -> torch.Tensor:
        """Each sequence's reward minus the mean of this player's rewards in the
        same seat (`seats`: the first seat loses 1/18 a game at equilibrium), over
        the player's std."""
        centered = rewards.clone()
        for seat in (0, 1):
            mine = seats == seat
            if mine.any():
                centered[mine] -= rewards[mine].mean()
        return centered / (centered.std() + 1e-6) if len(centered) > 1 else centered

    # --- figures ------------------------------------------------------------------------

    def rollout_metrics(
        self, name: str, rewards: torch.Tensor, games: list, batch: TrainBatch
    ) -> dict:
        mine = [g.history for g in games for s in g.sequences if g.players[s] == name]
        return {
            f"{name}/reward/mean": rewards.mean().item(),
            f"{name}/tokens/trained": int(batch.completion_mask.sum()),
            f"{name}/games/folds": sum(h.endswith("f") for h in mine) / len(mine),
        }

    def evaluate(self) -> dict[str, float]:
        """Every player against each fixed opponent in `eval_games` held-out games
        (the same deals each time), and its exact exploitability."""
        cfg, rng = self.cfg, random.Random(f"eval-{self.cfg.run.seed}")
        games = {
            (name, opponent): deal(cfg.eval_games, [(name, opponent), (opponent, name)], rng)
            for name in self.players
            for opponent in FIXED
        }
        self.match.play([g for part in games.values() for g in part], rng)
        figures = {}
        for (name, opponent), part in games.items():
            for key, value in results(part, name).items():
                figures[f"eval/{name}/{key}_vs_{opponent}"] = value
        batch, keys = strategy_batch(self.tokenizer)
        for name, player in self.players.items():
            logprobs = self.sup.call_rows(player.trainer, "logprobs", batch)
            figures[f"eval/{name}/exploitability"] = kuhn.exploitability(
                strategy_of(logprobs, keys)
            )
        return figures

    def stop(self, save: bool = True) -> None:
        """Save each player's final model (`final/a`, `final/b`, per
        `run.save_final`), draw the curve, stop every proc. Safe to call twice."""
        if self.runtime is None:
            return
        try:
            if save and self.log is not None:
                if self.cfg.run.save_final:
                    for name, player in self.players.items():
                        self.sup.call_all(
                            player.trainer, "save", f"{self.runtime.dir}/final/{name}"
                        )
                self.log.close()
        finally:
            self.close()


if __name__ == "__main__":
    run_main(Coevolve, CoevolveConfig)
