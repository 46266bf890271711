"""The `torchmoe` subcommands, one module each: `cli` parses the first word and reports errors and
exit statuses; `train`, `eval`, `generate`, `plan` (with `calibrate` and `calibrate_steps` behind
`plan --calibrate`), `report`, `convert`, `prepare_data` and `lighthouse` are the commands;
`job` finds and checks the job a command runs, `exits` the statuses and messages the commands
share, `arguments` the argparse whose usage errors are `ConfigError`s.

The top layer: a command imports the library below it (the trainer, preflight, checkpoints, optimizers, ...),
and nothing below imports a command.
"""
