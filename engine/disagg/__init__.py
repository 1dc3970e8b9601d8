"""Prefill/decode disaggregation: the rooms of a prefill and of a decode host (`rooms.py` has
the picture), the stages' KV export and import, and fault injection for testing it.

May import: `model`, `ppserve.scheduler` and `ppserve.transport`. The rooms talk to the engine
through `AsyncEngine`'s public methods; the runtime starts the stages' KV services.
"""
