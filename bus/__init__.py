"""ZeroMQ transport: one socket factory, an I/O thread that owns every socket, the gossip
channel (PUB/SUB) and request streams (DEALER/ROUTER)."""
