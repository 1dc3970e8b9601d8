"""Pure scheduling: requests, micro-batch planning, KV block accounting, chunk sizing.

Nothing here imports torch, sockets or asyncio.
"""
