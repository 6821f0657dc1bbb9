"""A proc's main where it is not a fork of the fork server (`job.fork_server:
false`, SLURM nodes): `python -m meshrl.procs.proc_main` runs Monarch's own proc
main, then ends the process without the interpreter's teardown (`zygote.fast_exit`),
as a forked proc does."""

import runpy

from meshrl.procs.zygote import BOOTSTRAP_MAIN, fast_exit

if __name__ == "__main__":
    code: object = 0
    try:
        runpy.run_module(BOOTSTRAP_MAIN, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
    fast_exit(code)
