"""The runtime: the engine core and its executors, the stage worker process and its runner,
recovery bookkeeping.

`core.py` holds the one serving loop (schedule, submit, await a result, update, emit); the
executors run its plans, in this process (`InProcessExecutor`) or in stage processes
(`StagePoolExecutor`, built on `stage_pool.py` and `stage_worker.py`).

May import: `model`, `cluster` and `disagg` (a stage serves KV transfers beside its pipeline),
`ppserve.scheduler` and `ppserve.transport`. Never the server.
"""
