"""What a run reports as it goes: metrics.jsonl, the console line and TensorBoard (`metrics`),
metrics.jsonl read back (`metrics_records`), W&B (`wandb_logger`), and where its log messages go:
the console and each rank's log file (`run_logs`).
"""
