"""Several dtrain jobs one after another in one torchrun launch (its workers' imports paid once).

``python dtrain_jobs.py '<json list of dtrain argument lists>'``: each job is ``dtrain ARGS`` as `cli.main`
runs it, with its own process group (made through torchrun's store, destroyed at the job's end: see
test_cli's test_a_second_trainer_after_close_under_torchrun_does_not_hang). Rank 0 marks on stdout and on
stderr where each job's output starts (``==== dtrain job <i>``). The first job that fails ends the launch
with its status."""

import json
import logging
import os
import sys

from distributed_training import cli

code = 0
for i, argv in enumerate(json.loads(sys.argv[1])):
    if os.environ.get("RANK", "0") == "0":
        for stream in (sys.stdout, sys.stderr):
            stream.write(f"==== dtrain job {i}\n")
            stream.flush()
    code = cli.main(argv)
    if code:
        break
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
