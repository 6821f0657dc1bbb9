"""A proc's main where it is not a fork of the fork server (`job.fork_server:
false`, SLURM nodes): `python -m meshrl.procs.proc_main` runs Monarch's own proc
main, then ends the process without the interpreter's teardown (`zygote.fast_exit`),
as a forked proc does."""

import os

from meshrl.procs.zygote import BOOTSTRAP_MAIN, fast_exit, run_module

if __name__ == "__main__":
    if os.environ.get("MESHRL_CHANNEL_DIR"):  # (LD_PRELOAD does it too, where it was kept)
        from meshrl.procs import channels

        channels.hook_process()
    fast_exit(run_module(BOOTSTRAP_MAIN))
