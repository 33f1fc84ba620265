"""Paged KV-cache layouts: one spec class per layout and their registry (:mod:`.specs`), the
gather of a request's blocks into the send buffer (:mod:`.gather`), the scatter of received
tokens into a cache (:mod:`.scatter`), and the sender's per-layer preparation (:mod:`.cache`)."""
