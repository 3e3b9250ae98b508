"""Devices and hosts: the mesh and logical-axis sharding rules (`sharding`), multi-host start-up
(`distributed`), and work only process 0 does with its outcome shared by all (`process_zero`).

The lowest layer: imports only jax and the standard library.
"""
