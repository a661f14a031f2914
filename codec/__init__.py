"""The specbus wire format: msgpack headers plus raw tensor frames.

This package imports nothing else of specbus, so every layer can depend on it.
"""
