"""The replica on vLLM's engine (``cachepoint-replica --engine vllm``).

vLLM computes the KV and keeps its own pool; everything Cachepoint promises stays ours:

- ``scope``: the gateway's key spans folded into one vLLM ``cache_salt``;
- ``checkpoint``: the HF folder vLLM loads (a checkpoint as is; random weights and GGUF
  files exported once);
- ``events``: vLLM's KV events (ZMQ) replayed into a kvcore ``PoolMirror``, whose
  kvcore-space events go out on NATS like any replica's;
- ``engine``: one ``AsyncLLM`` and the facts the core needs of it;
- ``core``: ``VllmCore``, the ``ReplicaCore`` the API, bus and metrics drive.

Only ``engine``, ``events.subscribe`` and ``core`` import vLLM, and only when a vLLM
replica starts: the rest is importable (and tested) in the main environment.
"""
