"""The ranks of one stage: parallel context, collectives, host discovery, and the leader's
distribution of received KV to its followers."""
