"""Records every `os.fsync`, `os.rename` and `os.replace` of a process and the code that made it,
for tests/distributed/test_fault_tolerance.py: on this folder's PYTHONPATH with
TORCHMOE_FILE_SYNCS naming a folder, each process writes ``<pid>.json`` there at exit:
``{"rank": RANK or None, "calls": [{"call": name, "stack": ["file.py:function", ...]}, ...]}``.
Without the variable it does nothing."""

import atexit
import json
import os
import traceback

_folder = os.environ.get("TORCHMOE_FILE_SYNCS")
if _folder:
    _calls: list[dict] = []

    def _recorded(name: str, real):
        def call(*args, **kwargs):
            stack = [f"{os.path.basename(frame.filename)}:{frame.name}" for frame in traceback.extract_stack()[:-1]]
            _calls.append({"call": name, "stack": stack})
            return real(*args, **kwargs)
        return call

    for _name in ("fsync", "rename", "replace"):
        setattr(os, _name, _recorded(_name, getattr(os, _name)))

    def _write() -> None:
        with open(os.path.join(_folder, f"{os.getpid()}.json"), "w") as f:
            json.dump({"rank": os.environ.get("RANK"), "calls": _calls}, f)

    atexit.register(_write)
