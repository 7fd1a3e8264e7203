"""A receiving peer of the trainer's weight broadcast, as SGLang's end does it (the same group helper, flattened
buckets rebuilt by byte offsets): ``python weight_peer.py OFFER_JSON RANK OUT.pt``; writes what it received."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from agentrl.trainer.weight_sync import open_group
from agentrl.weight_sync import WeightOffer


def main() -> None:
    offer = WeightOffer.from_dict(json.loads(sys.argv[1]))
    rank, out = int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore(offer.address, offer.port, offer.world_size, is_master=False)
    pg = open_group(store, group=offer.group, world_size=offer.world_size, rank=rank, backend=offer.backend,
                    timeout_s=offer.timeout_s)
    got: dict[str, torch.Tensor] = {}
    for bucket in offer.buckets:
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
        dist.broadcast(flat, group=pg, group_src=0)
        offset = 0
        for name, shape in zip(bucket.names, bucket.shapes):
            dtype = getattr(torch, bucket.dtype)
            n = dtype.itemsize
            for d in shape:
                n *= d
            got[name] = flat[offset:offset + n].view(dtype).reshape(shape).clone()
            offset += n
    dist.destroy_process_group(pg)
    torch.save(got, out)


if __name__ == "__main__":
    main()
