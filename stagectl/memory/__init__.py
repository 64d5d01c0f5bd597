"""stagectl.memory: the per-rank training memory model (pure Python, no torch): model shapes from a
`config.json` (`shapes`), the per-rank breakdown (`estimate`), its inputs from a config (`from_config`)
and the published shapes of the checkpoints the docs table covers (`reference`). Import the submodules."""
