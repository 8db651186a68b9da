"""Other servers' logs read by `gateway analyze`: TGI, vLLM and nginx.

When the gateway is not (yet) in the path, the logs that exist are the model
server's or the proxy's. Each module reads one source's documented line shape
into plain dicts and says what that source can and cannot tell about the tail;
`detect` decides per line which source wrote it. Unreadable lines are counted,
never fatal.
"""
