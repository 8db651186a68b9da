"""`gateway replay`: the same traffic, direct to the engines and through the gateway's own
scheduler, on one virtual clock (no sleeping, no sockets)."""
