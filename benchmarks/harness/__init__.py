"""What the benchmarks share: result records (record), the peers' set-up and servers (peers_setup,
peer_servers), and the tests' helpers they borrow (testbed)."""
