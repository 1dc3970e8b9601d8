"""The engine: `AsyncEngine` (the public in-process API), `EngineConfig`, and one sub-package
per concept. Dependencies point one way:

    async_engine, config  ->  runtime  ->  cluster, disagg  ->  model

- `model/`: what a stage computes (model, attention, weights, sampling, tokenizer);
- `runtime/`: the engine core and its executors, the stage worker and runner;
- `cluster/`: multi-node rendezvous, other nodes' stages, devices;
- `disagg/`: prefill/decode rooms, KV export and import.

tests/repo/test_import_graph.py checks these rules.
"""
