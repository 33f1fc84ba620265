"""A forger in its own process: it can publish into the engines' namespace but lacks their secret.

``python forger.py '<json>'`` builds a streaming sender manager on ``conn`` (the engines'
connector config), stamps its payloads as told (``session``, ``epoch``, ``seq``: the next
sequence number, ``instance``: all readable from any genuine payload's header) and streams a
forged prefill (every value 1, ``tokens`` tokens of ``layers`` layers) under ``key`` with a
wrong MAC in every chunk. It prints ``sent`` once the chunks are published, then waits for EOF
on stdin (the consumer's refusal) and closes. Used by the check-then-remember attack tests.
"""

from __future__ import annotations

import itertools
import json
import sys


def main(spec: dict[str, object]) -> None:
    import torch

    from omnikv.config import config_from_dict, options_from_dict
    from omnikv.manager import OmniKVTransferManager

    cfg = {
        "omni_from_stage": 0,
        "omni_to_stage": 1,
        "need_send_cache": True,
        "stream_kv": True,
        "connector_config": spec["conn"],
    }
    block, heads, dim, blocks = (int(spec[k]) for k in ("block", "heads", "dim", "blocks"))  # type: ignore[call-overload]
    caches = [
        (torch.ones(blocks, block, heads, dim), torch.ones(blocks, block, heads, dim))
        for _ in range(int(spec["layers"]))  # type: ignore[call-overload]
    ]
    with OmniKVTransferManager(config_from_dict(cfg), options=options_from_dict(cfg)) as mgr:
        stamps = mgr.edge._sender.stamps  # what a forger writes into its headers by hand
        stamps.session = str(spec["session"])
        stamps.epoch = int(spec["epoch"])  # type: ignore[call-overload]
        stamps.instance_id = None if spec["instance"] is None else str(spec["instance"])
        stamps._seq = itertools.count(int(spec["seq"]))  # type: ignore[call-overload]
        tokens = int(spec["tokens"])  # type: ignore[call-overload]
        progress = mgr.stream_kv_blocks(
            str(spec["key"]),
            {"block_ids": list(range(tokens // block)), "seq_len": tokens},
            caches,
            block,
            "float32",
            seal=lambda start, stop, ids: {"omnikv_mac": "omnikv-kv-v4:" + "0" * 32},
        )
        if progress.reason is None:  # handed to the stream worker: what it published
            progress = mgr.wait_kv_stream(str(spec["key"]), 30.0)
        print("sent" if progress.new == tokens else f"failed {progress!r}", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
