"""Who sends what to whom: tensor-parallel math and head slicing (:mod:`.tp`), transfer keys,
stage ids and hooks (:mod:`.keys`), stage placement, endpoints and ports (:mod:`.placement`).
Plain values and pure functions; no process groups."""
