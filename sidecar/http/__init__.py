"""The sidecar's HTTP plumbing, shared by the proxy (to llama-server) and the forwarder (to peers).

- ``headers``: the header names kvtier uses and the one hop-by-hop set every relay leaves out.
- ``upstream``: ``Upstream``, the lean HTTP/1.1 client to llama-server, whose kept connections
  also witness that its process has not restarted.
- ``relay``: the one loop that streams an answer (llama-server's or a peer's) back to the client,
  and ``Relay``, what it saw (status, whole or cut, client gone, the answer's end).
"""
