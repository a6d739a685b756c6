"""What the tests share and are not tests themselves: running a training as a user does (runs.py), S3 faults at a
proxy (faults.py), the fault campaign (chaos.py, also a command), crafted files for the readers (hostile.py), the
metrics the code declares (metric_source.py) and a checkpoint writer to kill (save_forever.py)."""
