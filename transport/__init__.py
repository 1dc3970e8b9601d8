"""Wire messages, the ZeroMQ control plane and the tensor channels between stages."""
