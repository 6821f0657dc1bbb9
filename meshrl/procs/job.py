"""Where the role meshes live: the `job:` config section on Monarch's job launchers.

`kind: local` (default) puts every role on this host. The other kinds build a
`monarch.job` job with one host mesh per role, `job.hosts[role]` hosts each
(1 when not named), and each host runs `placement.<role>` procs:

- `process`: each "host" is a local subprocess (`monarch.job.ProcessJob`), for
  testing multi-host runs on one machine;
- `slurm`: each role's hosts are a SLURM job of their own, submitted with
  sbatch (`meshrl.procs.slurm`, which says what Monarch's own `SlurmJob` got wrong);
- `kubernetes`: `monarch.job.kubernetes.KubernetesJob` provisions pods from
  `job.image` through the MonarchMesh operator, or attaches to pods already
  running when no image is given (needs the `kubernetes` package:
  `pip install -e '.[kubernetes]'` in a meshrl checkout).

The algorithm script does not change between kinds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from meshrl.config import ConfigError

KINDS = ("local", "process", "slurm", "kubernetes")

_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
_K8S_NAME = re.compile(r"^[a-z][a-z0-9]{0,39}$")


@dataclass
class JobConfig:
    """Where the meshes live (see meshrl/procs/job.py and docs/launch.md)."""

    kind: str = "local"
    """local (this host), process (local subprocess hosts), slurm, or kubernetes."""
    hosts: dict[str, int] = field(default_factory=dict)
    """Hosts per role, e.g. {trainer: 2}; roles not named get 1. Not for `local`."""
    max_procs: dict[str, int] = field(default_factory=dict)
    """Procs an elastic role (policy, environment) may be scaled to, e.g. {policy: 4}.
    Unset: what it starts with on `process`, `slurm` and `kubernetes` jobs, and
    this host's cores (GPUs) on `local`. On `process`, `slurm` and
    `kubernetes`, procs past the job's hosts go on hosts that join the run:
    each a one-host job of the same kind (an sbatch allocation, a pod), since
    Monarch 0.7 adds no host to a running job; it is stopped with its last proc."""
    fork_server: bool = True
    """`local` and `process` jobs (every host on this machine): every proc is a fork
    of one server process that imported torch, transformers and meshrl's modelling
    code once (`meshrl.procs.zygote`), so a proc starts in a fraction of a second
    instead of about 7 s of CPU, a lost proc is replaced as fast, and several procs
    do not import at once on shared cores. false: every proc starts as a fresh
    Python (as on `slurm` and `kubernetes`, whose hosts are other machines)."""
    name: str = "meshrl"
    """Job name: the SLURM job name; on Kubernetes the prefix of each role's mesh
    name (`meshrltrainer`), so lowercase letters and digits only there."""
    # SLURM
    partition: str | None = None
    """SLURM partition."""
    gpus_per_node: int | None = None
    """GPUs to request per node (SLURM) or per pod (Kubernetes)."""
    time_limit: str | None = None
    """SLURM time limit, [D-]HH:MM:SS."""
    account: str | None = None
    """SLURM account to charge (sbatch --account); None: the default."""
    qos: str | None = None
    """SLURM quality of service (sbatch --qos); None: the default."""
    python_exe: str = "python"
    """Python on the worker nodes (SLURM); must import meshrl and monarch."""
    slurm_args: list[str] = field(default_factory=list)
    """Extra sbatch arguments, e.g. ["--constraint=h100"]."""
    job_start_timeout_s: int | None = None
    """How long to wait for the allocation (SLURM) or the pods (Kubernetes); None:
    as long as it takes (SLURM: its pending reason printed every 30 s). A SLURM job
    whose pending reason never clears (a partition's node limit) fails at once."""
    warn_before_s: int = 120
    """SLURM with a time_limit: seconds before the limit at which SLURM warns the
    job (`--signal=B:USR1@N`); the run then writes a checkpoint at the end of its
    step and requeues its jobs, and goes on when SLURM starts them again."""
    # Kubernetes
    namespace: str = "default"
    """Kubernetes namespace of the pods."""
    image: str | None = None
    """Worker image to provision pods from; None attaches to running pods by label."""

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(
                f"config key 'job.kind': '{self.kind}' is not one of {', '.join(KINDS)}"
            )
        for role, count in self.hosts.items():
            if not isinstance(count, int) or count < 1:
                raise ConfigError(f"config key 'job.hosts.{role}': must be an integer >= 1")
        for role, count in self.max_procs.items():
            if not isinstance(count, int) or count < 1:
                raise ConfigError(f"config key 'job.max_procs.{role}': must be an integer >= 1")
        if self.kind == "local" and any(n != 1 for n in self.hosts.values()):
            raise ConfigError(
                "config key 'job.hosts': a local job has one host; use job.kind=process, "
                "slurm or kubernetes for more"
            )
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ConfigError("config key 'job.gpus_per_node': must be >= 0")
        if self.warn_before_s < 1:
            raise ConfigError("config key 'job.warn_before_s': must be >= 1")
        if self.time_limit is not None and not _TIME.match(self.time_limit):
            raise ConfigError(
                f"config key 'job.time_limit': '{self.time_limit}' is not [D-]HH:MM:SS"
            )
        if self.kind == "kubernetes" and not _K8S_NAME.match(self.name):
            raise ConfigError(
                f"config key 'job.name': '{self.name}' must be lowercase letters and digits, "
                "starting with a letter, for Kubernetes mesh names"
            )

    def hosts_for(self, role: str) -> int:
        return 1 if self.kind == "local" else self.hosts.get(role, 1)


def mesh_name(cfg: JobConfig, role: str) -> str:
    """The host mesh a role lives on (Kubernetes mesh names: lowercase alphanumeric)."""
    return f"{cfg.name}{role}" if cfg.kind == "kubernetes" else role


def build_job(
    cfg: JobConfig,
    roles: list[str],
    observe: Any = None,
    cpu_roles: tuple[str, ...] = (),
    log_dir: str | None = None,
) -> Any:
    """The Monarch job for `roles` (None for `local`, unless `observe`, a
    `meshrl.observe.monarch.Observe`, asks for telemetry: a `LocalJob`). Nothing is
    started yet; `cpu_roles` ask for no GPUs (SLURM); `log_dir`: where SLURM's jobs
    write their output (default `meshrl.procs.slurm.LOG_DIR`). Before anything of Monarch's
    serves: this process's channels and those of every process it starts are made
    private (`meshrl.procs.channels`)."""
    from meshrl.procs import channels

    channels.seal()
    job = _job(cfg, roles, observe is not None, cpu_roles, log_dir)
    if observe is not None:
        observe.enable(job, cfg.kind)
    return job


def _job(
    cfg: JobConfig,
    roles: list[str],
    observed: bool,
    cpu_roles: tuple = (),
    log_dir: str | None = None,
) -> Any:
    meshes = {mesh_name(cfg, role): cfg.hosts_for(role) for role in roles}
    if cfg.kind == "local":
        if observed:  # Monarch's telemetry hangs on a job; this one is this host
            from monarch.job import LocalJob

            return LocalJob(tuple(meshes))
        return None
    from monarch.config import configure

    # Monarch pushes its config to each host it attaches and waits 10 s for them all
    # (its default); on a loaded machine a host missed that ("config push failed during
    # attach on 1 host(s)", then no answer from its procs): a minute, as for the rest.
    configure(mesh_attach_config_timeout="60s")
    if cfg.kind == "process":
        from monarch.job import ProcessJob

        return ProcessJob(meshes)
    if cfg.kind == "slurm":
        from meshrl.procs.slurm import LOG_DIR, make_job

        cpu = {mesh_name(cfg, role) for role in cpu_roles}
        return make_job(cfg, meshes, cpu, log_dir or LOG_DIR)
    try:
        from monarch.job.kubernetes import ImageSpec, KubernetesJob
    except (ImportError, RuntimeError):
        raise ConfigError(
            "config key 'job.kind': kubernetes needs the kubernetes package "
            "(pip install -e '.[kubernetes]' in a meshrl checkout)"
        ) from None
    job = KubernetesJob(namespace=cfg.namespace, timeout=cfg.job_start_timeout_s)
    for name, count in meshes.items():
        image = None
        if cfg.image is not None:
            resources = {"nvidia.com/gpu": cfg.gpus_per_node} if cfg.gpus_per_node else None
            image = ImageSpec(cfg.image, resources=resources)
        job.add_mesh(name, count, image_spec=image)
    return job


def joining_job(
    cfg: JobConfig, role: str, index: int | str, log_dir: str | None = None
) -> tuple[Any, str]:
    """A one-host job of `cfg`'s kind for a proc of `role` past the run's hosts
    (its host `index`), and the name of its host mesh; nothing is started yet.
    `log_dir`: where a SLURM job writes its output (the run's, as for its other jobs)."""
    if cfg.kind == "local":
        raise ValueError("a local job has one host")
    name = f"{role}joined{index}"  # (Kubernetes: lowercase letters and digits)
    one = replace(cfg, hosts={name: 1})  # (SLURM: job `<job.name>-<name>`)
    return _job(one, [name], False, (), log_dir), mesh_name(one, name)


def host_meshes(cfg: JobConfig, job: Any, roles: list[str], observe: Any = None) -> dict[str, Any]:
    """Role -> Monarch HostMesh, starting the job (None for `local`: this host)."""
    if job is None:
        from monarch.actor import this_host

        return {role: this_host() for role in roles}
    state = job.state(cached_path=None)
    if observe is not None:
        observe.started(job, state, cfg.kind)
    return {role: getattr(state, mesh_name(cfg, role)) for role in roles}
