"""Which weights a job starts from or reads, and the model they are: a new run's
`checkpoint.initial_load_path` (`initial_load`), a run from a Hugging Face folder building the
model its config.json describes (`folder_model`), and the trained weights `eval` and `generate`
read (`trained_weights`).
"""
