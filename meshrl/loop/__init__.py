"""The pieces a controller loop composes: the run (its directory, meshes and stop
request), supervision and recovery, checkpoints, the loop state and its ledger,
weight-sync bookkeeping, collecting and dispatching rollouts, evaluation, step
logging, supervised steps, two-player games, elastic pools, and meshes kept
across notebook cells."""
