"""frontend/bridge/: the GPU host's process (`--role gpu`): edges' requests over CURVE into the same
engine and `Shell` as the client frontend. Imports frontend/core/ and the shared modules only.
"""
