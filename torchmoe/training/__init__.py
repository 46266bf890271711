"""The `torchmoe train` and `torchmoe eval` commands' training stack: a short loop over named parts.

Highest first (the import-linter contract "the training loop sits above its parts"):

- `session`: joins the launched world and runs a `Trainer` (`train`, `evaluate`);
- `loop`: the `Trainer`, which builds the parts and steps them (`Trainer.fit`);
- the parts, each one job: `model_build` (the model and its parallelism), `objective` (the loss),
  `optimization` (optimizer, schedule, the trainable subset), `placement` (a batch's local
  columns), `step` (forward, backward, reduction, clipping, the optimizer step), `moe_balance`
  (routed-token counts and expert biases), `replicas` (the live state replica groups exchange),
  `adapters` and `adapter_checkpoint` (LoRA's trainable subset, loads, checkpoints and export),
  `checkpointing`, `validation`, `step_metrics` (each step's record) and `console`;
- below them: `run_files`, `world`, `progress` and `log`.
"""
