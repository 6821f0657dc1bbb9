"""The controller's pieces compose beyond the fixed role set: two policy/trainer pairs
train apart in one script."""

import pytest
import torch

from algorithms.grpo import GRPO
from meshrl.loop.state import LoopState
from meshrl.types import TrainBatch
from tests.support.runs import configure

# --- the pieces compose beyond the fixed role set ------------------------------------------


@pytest.mark.actors
@pytest.mark.timeout(300)
def test_two_policy_trainer_pairs_train_apart_in_one_script(tmp_path, no_stray_procs):
    """Two independent policy + trainer pairs (different seeds, different numbers
    of steps) and one environment mesh, composed from the pieces: each pair's
    replicas serve its own trainer's weights and version, never the other's."""
    from actors.environment import Environment
    from actors.policy import Policy
    from actors.trainer import Trainer
    from meshrl.loop.collector import Collector
    from meshrl.loop.run import Run
    from meshrl.loop.supervisor import Supervisor
    from meshrl.loop.weight_sync import WeightSync
    from meshrl.model.losses import group_advantages

    cfg = configure(tmp_path, "two", "prompts_per_step=4")
    algo = GRPO(cfg)  # for its tokenizer, task and loss hook
    procs = {"policy_a": 1, "trainer_a": 1, "policy_b": 1, "trainer_b": 1, "environment": 1}
    state = LoopState(seed=cfg.run.seed)
    with Run(cfg, "two", procs) as run:
        sup = Supervisor(run, cfg.faults, state)
        environment = run.spawn("environment", Environment, cfg.task, cfg.model)
        pairs = {}
        for name, seed in (("a", 0), ("b", 1)):
            trainer = run.spawn(
                f"trainer_{name}",
                Trainer,
                cfg.model,
                cfg.optim,
                loss_fn=algo.make_loss(),
                total_steps=10,
                seed=seed,
                shm_prefix=run.shm_prefix,
                rendezvous=True,
            )
            policy = run.spawn(f"policy_{name}", Policy, cfg.model, seed, cfg.policy, algo.context)
            sync = WeightSync(sup)
            sync.pull(policy, sync.publish(trainer))  # each replica takes its trainer's v0
            collector = Collector(
                cfg, state, sup, sync, algo.tokenizer, algo.task, algo.context, policy, environment
            )
            pairs[name] = (policy, trainer, sync, collector)
        for name, steps in (("a", 3), ("b", 2)):
            policy, trainer, sync, collector = pairs[name]
            for _ in range(steps):
                completions, rewards, _ = collector.generate_and_score(
                    collector.sample_prompts(cfg.prompts_per_step)
                )
                batch = TrainBatch.from_completions(completions)
                batch.advantages = group_advantages(rewards, cfg.group_size)
                sup.call_sharded(trainer, "train_step", batch)
                sync.pull(policy, sync.publish(trainer))
        weights = {}
        for name, (policy, trainer, _, _) in pairs.items():
            served = sup.call_all(policy, "parameters")[0]
            trained = sup.call_all(trainer, "parameters")[0]
            assert all(torch.equal(served[k], trained[k]) for k in trained), name
            weights[name] = trained
        assert pairs["a"][2].version == 3 and pairs["b"][2].version == 2
        assert all(not torch.equal(weights["a"][k], weights["b"][k]) for k in weights["a"])
        assert state.ledger.generated == 5 * cfg.prompts_per_step * cfg.group_size
