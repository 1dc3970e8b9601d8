"""Across machines: the cluster's shape and rendezvous, the host's view of other nodes'
stages, devices, and the checkpoint fingerprint nodes compare when they join.

May import: `model` (to fingerprint a checkpoint), `ppserve.transport`. Never the runtime or
disaggregation: the runtime uses the cluster, not the other way round.
"""
