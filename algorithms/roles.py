"""The roles every algorithm spawns the same way: the trainer and the policy
replicas (with a replica's tensor-parallel group). Plain functions of the run,
the config and what differs per call (the role's name, its seed, its weight
slots), so that each algorithm's `run()` spawns its roles by name:

    trainer = spawn_trainer(run, cfg, self.make_loss(), temperature)
    policy = spawn_policy(run, cfg, self.context)
"""

from __future__ import annotations

from typing import Any

from meshrl.loop.checkpoint import Checkpointer
from meshrl.loop.run import Role, Run
from meshrl.loop.supervisor import Supervisor
from meshrl.loop.weight_sync import WeightSync
from meshrl.procs.mesh import RemoteCallError, form_groups

TRAINER_STEPS = ("train_step", "warm_start_step")
"""The trainer's endpoints that change its state (a healed rank takes it again)."""


def spawn_trainer(
    run: Run,
    cfg: Any,
    loss: Any,
    temperature: float = 1.0,
    role: str = "trainer",
    seed: int | None = None,
    shm_prefix: str = "",
    full_readers: bool = False,
    replicas: bool = True,
) -> Role:
    """The trainer mesh from `model`, `optim` and `trainer` (micro-batches, layout,
    routing replay, `trainer.precision`): its LR schedule over `cfg.total_updates`
    optimizer steps, `loss` (the algorithm's loss object, pickled whole to every
    proc), its log-probs at the sampling `temperature` (1 where nothing samples),
    `placement.sharding`, and its groups of procs that take the same rows
    (`placement.trainer_group`: a pipeline's stages of tensor-parallel groups). It publishes each version in the
    replicas' precision (`policy.precision`; `replicas` False: an algorithm with
    none), and in its own where `full_readers` pull it too (a frozen reference
    copy, a critic's backbone). Its weight slots:
    `shm_prefix`'s (default: the run's)."""
    from actors.trainer import Trainer

    return run.spawn(
        role,
        Trainer,
        cfg.model,
        cfg.optim,
        loss_fn=loss,
        total_steps=cfg.total_updates,
        temperature=temperature,
        seed=cfg.run.seed if seed is None else seed,
        sharding=cfg.placement.sharding,
        tp=cfg.placement.trainer_tp,
        replica_tp=cfg.placement.policy_tp,
        shm_prefix=shm_prefix or run.shm_prefix,
        micro_batches=cfg.trainer.micro_batches,
        layout=cfg.trainer.layout,
        routing_replay=cfg.trainer.routing_replay,
        rendezvous=True,
        tensor_parallel=cfg.placement.trainer_group,
        precision=cfg.trainer.precision,
        pp=cfg.placement.trainer_pp,
        pp_schedule=cfg.trainer.pp_schedule,
        pp_microbatches=cfg.trainer.pp_microbatches,
        ep=cfg.placement.ep,
        precisions=cfg.trainer.published(cfg.model, cfg.policy if replicas else None, full_readers),
    )


def spawn_policy(
    run: Run,
    cfg: Any,
    context: int,
    role: str = "policy",
    seed: int | None = None,
    shm_prefix: str = "",
    tp: int = 1,
    partial: bool = False,
    lengths: Any = None,
) -> Role:
    """The policy replicas from `model` and `policy`, `context` tokens long; each
    reads its weights from `shm_prefix`'s slots (the trainer's of the same prefix)
    on its host. With `tp > 1` each replica is a tensor-parallel group: its
    leader's procs are `role`'s, its followers' `<role>_tp`'s, and the groups
    form here (`group_replicas`)."""
    from actors.policy import Policy

    args = (cfg.model, cfg.run.seed if seed is None else seed, cfg.policy, context)
    kwargs = dict(role_name=role, partial=partial, lengths=lengths, tp=tp)
    prefix = shm_prefix or run.shm_prefix
    policy = run.spawn(role, Policy, *args, prefix, **kwargs, grouped=tp > 1)
    if tp > 1:
        run.spawn(f"{role}_tp", Policy, *args, prefix, **kwargs, leader=False, grouped=True)
        group_replicas(run, cfg.run.call_timeout_s, role)
    return policy


def group_replicas(run: Run, timeout_s: float, role: str = "policy") -> None:
    """Form `role`'s tensor-parallel replicas: a fresh store on each leader proc,
    every proc of the leaders and followers joins its group at once
    (`Policy.join`), and each leader takes its followers (`Policy.follow`;
    `meshrl.procs.mesh.form_groups`)."""
    leaders, followers = run.roles[role], run.roles[f"{role}_tp"]
    tp = followers.size // leaders.size + 1
    masters = run.meshes.rendezvous_each(role)
    form_groups(leaders.actors, followers.actors, leaders.size, tp, masters, timeout_s)


def heal_trainer(sup: Supervisor, cfg: Any, trainer: Role, sync: WeightSync) -> None:
    """A DDP trainer's ranks are replicas: a lost one is healed from the others
    (`Supervisor.heal_from_peers`), the new procs publishing the version `sync`
    holds. A sharded (FSDP2) trainer, or one whose procs hold different experts
    (`placement.ep`), goes back to its checkpoint."""
    if cfg.placement.sharding == "ddp" and cfg.placement.ep == 1:
        sup.heal_from_peers(trainer.name, TRAINER_STEPS, lambda: sync.republish(trainer))


def restore_frozen(sup: Supervisor, ckpt: Checkpointer, reference: Role) -> None:
    """A replaced frozen copy (a KL reference) takes its weights from the newest
    checkpoint: it can pull them from nowhere else."""
    saved = ckpt.latest(rehash=True)
    if saved is None:
        raise RemoteCallError(
            f"{reference.name} lost (a frozen copy is recovered from a checkpoint: set "
            "checkpoint.every)",
            reference.name,
            proc_lost=True,
        )
    sup.call_all(reference, "load_state", saved)
