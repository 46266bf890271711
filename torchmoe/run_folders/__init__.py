"""A run's folders: owned by one run at a time (`run_lock`), and the facts of a run that its
config does not hold (`run_info`: run_info.json).
"""
