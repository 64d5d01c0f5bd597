"""A run directory, from the command that opens it to the one that resumes it. Pure path logic, no torch:
the CLI calls it before any server or rank starts.

- `policy`: what a command does with an output directory that already holds a run (refuse, `--resume`,
  `--overwrite`) and the clean-up of a start that failed before its first step;
- `ending`: how a train-ab run ended (`final_state.json`) and the lines that say how to continue it;
- `resume`: what a `--resume` continues from and what it checks first (world size, a changed config);
- `liveness`: whether the run is still going (`running.json`: the process of rank 0, until the run ends).
"""
