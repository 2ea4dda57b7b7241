"""The P/D contract: what the server, the router, the engine and the transfer layer all agree on about KV.

Pure Python (no torch, numpy or nixl; tests/unit/test_layers.py checks it), so the router and the server's
request path import it without the data plane:
  params.py      kv_transfer_params: vLLM's key names, typed values (RemoteDecode, PullSource, PushSource; P's
                 answers PushAnswer, Refusal) and the one encode
  decode.py      kv_transfer_params in: decode / decode_answer, the edge's validation (a 400 naming the key)
  capability.py  capabilities on kv_transfer_params: issued by P (pull) or the router (push), checked at the edge
  groups.py      the KV cache's layer groups (sliding windows): which layers share a block, STALE entries
  geometry.py    CacheGeometry: the block-major cache's sizes and byte offsets, which the engine allocates,
                 KVCacheSpec and the handshake's PeerInfo carry, and the transfer layout addresses
  block_hashes.py  the prefix cache's block keys (chained blake2b over token ids), which GET /kv_events names
                 and a router hashes prompts with
  events_wire.py GET /kv_events' answer: a snapshot or ordered runs of stored/removed keys, epoch, seq
"""
