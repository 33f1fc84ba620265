"""Streaming a request's KV while it decodes, split by direction: :mod:`.sending` (the
sender's streams: chunks per step, the tail's plan at the finish), :mod:`.receiving` (a
receive's chunks taken ahead, checked and joined, or handed to ``on_chunk``) and
:mod:`.manifest` (the chunk key space and the manifest's checks, shared by both and importing
neither). Each module is used one way only: the edge uses :mod:`.sending`, the receiver
:mod:`.receiving`. This package imports none of them, so that importing one never drags in
the other direction."""
