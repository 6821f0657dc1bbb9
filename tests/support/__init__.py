"""What the tests share, in one place: helpers that test files of several tiers use
(`runs`: starting runs and reading what they log), the pieces both halves of a
split file use, and the modules runs load by name (`task.name=tests.support.envs:Flaky`,
`agent:tests.support.agent:...`, `verifiers:tests.support.vf_taskset`), the sandbox's
hostile programs and a private SLURM cluster (`python -m tests.support.slurm_cluster`)."""
