"""Procs and where they run: role meshes, deadlines and shutdown, procs pooled
across runs, elastic pools, jobs (local, process, SLURM, Kubernetes), the
scheduler's faults, fault drills and the run's fault log, and data parallelism
inside one role's mesh."""
